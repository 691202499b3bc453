#!/usr/bin/env python
"""Train the MNIST classifier behind the MNIST score and FID (mdgan.evaluation).

Trains ``mdgan.evaluation.MnistClassifier`` on the MNIST training set, in the
GAN's value range [-1, 1], reports the accuracy on the full 10,000-image test
set, and writes the weights (a state dict, loaded with ``weights_only=True`` by
``load_mnist_classifier``) plus a JSON record next to them:

    python scripts/train_mnist_classifier.py --data-root /work/shared/data \
        --epochs 4 --seed 0 --out mdgan/assets/mnist_classifier.pt

The test set is only used for the final report, never for model selection.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from mdgan.evaluation import DEFAULT_WEIGHTS, MnistClassifier  # noqa: E402


def default_data_root() -> str:
    return os.environ.get("MDGAN_DATA_ROOT", str(REPO.parent / "shared" / "data"))


def load_split(data_root: str, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from torchvision.datasets import MNIST

    ds = MNIST(root=data_root, train=train, download=False)
    x = ds.data.unsqueeze(1).float() / 127.5 - 1.0  # (N,1,28,28) in [-1,1]
    return x, ds.targets.clone()  # (N,) int64


def random_shift(x: torch.Tensor, max_shift: int, g: torch.Generator) -> torch.Tensor:
    """Translate each image by up to max_shift pixels (background -1): x (B,1,28,28)."""
    if max_shift <= 0:
        return x
    b = x.shape[0]
    padded = F.pad(x, (max_shift,) * 4, value=-1.0)  # (B,1,28+2s,28+2s)
    dx = torch.randint(0, 2 * max_shift + 1, (b,), generator=g)
    dy = torch.randint(0, 2 * max_shift + 1, (b,), generator=g)
    ar = torch.arange(28)
    rows = (dy[:, None] + ar[None, :])[:, :, None].expand(b, 28, 28)  # (B,28,28)
    cols = (dx[:, None] + ar[None, :])[:, None, :].expand(b, 28, 28)  # (B,28,28)
    bi = torch.arange(b)[:, None, None].expand(b, 28, 28)
    return padded[bi, 0, rows, cols].unsqueeze(1)  # (B,1,28,28)


@torch.no_grad()
def accuracy(model: MnistClassifier, x: torch.Tensor, y: torch.Tensor, bs: int = 1000) -> float:
    model.eval()
    correct = 0
    for i in range(0, x.shape[0], bs):
        correct += (model(x[i : i + bs]).argmax(1) == y[i : i + bs]).sum().item()
    return correct / x.shape[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-root", default=default_data_root(),
                   help="torchvision MNIST root (default: $MDGAN_DATA_ROOT or <repo>/../shared/data)")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(DEFAULT_WEIGHTS), help="weights file (.pt); the JSON goes next to it")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (one-cycle)")
    p.add_argument("--max-shift", type=int, default=1, help="random translation augmentation, pixels")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--min-accuracy", type=float, default=0.99,
                   help="write nothing (exit 1) if the test accuracy is below this")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    g = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()

    x_train, y_train = load_split(args.data_root, train=True)
    x_test, y_test = load_split(args.data_root, train=False)

    model = MnistClassifier()
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    steps_per_epoch = -(-x_train.shape[0] // args.batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=args.lr, total_steps=args.epochs * steps_per_epoch, pct_start=0.15
    )

    for epoch in range(args.epochs):
        model.train()
        perm = torch.randperm(x_train.shape[0], generator=g)
        total_loss, seen = 0.0, 0
        for i in range(0, x_train.shape[0], args.batch_size):
            idx = perm[i : i + args.batch_size]
            xb = random_shift(x_train[idx], args.max_shift, g)  # (B,1,28,28)
            loss = F.cross_entropy(model(xb), y_train[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            total_loss += loss.item() * idx.numel()
            seen += idx.numel()
        print(f"epoch {epoch + 1}/{args.epochs}  train loss {total_loss / seen:.4f}  "
              f"elapsed {time.perf_counter() - t0:.0f}s", flush=True)

    test_acc = accuracy(model, x_test, y_test)
    wall = time.perf_counter() - t0
    print(f"test accuracy {test_acc:.4f} ({x_test.shape[0]} images), wall {wall:.0f}s", flush=True)

    if test_acc < args.min_accuracy:
        print(f"test accuracy below --min-accuracy {args.min_accuracy}: nothing written", flush=True)
        return 1

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    torch.save({"state_dict": state, "num_features": model.num_features}, out)
    record = {
        "test_accuracy": round(test_acc, 4),
        "test_images": int(x_test.shape[0]),
        "epochs": args.epochs,
        "seed": args.seed,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "max_shift": args.max_shift,
        "optimizer": "Adam + OneCycleLR",
        "parameters": n_params,
        "num_features": model.num_features,
        "input_range": "[-1, 1] (pixel / 127.5 - 1)",
        "weights_bytes": out.stat().st_size,
        "train_wall_s": round(wall, 1),
        "threads": args.threads,
        "torch": torch.__version__,
        "command": shlex.join(
            ["python", "scripts/train_mnist_classifier.py", *(sys.argv[1:] if argv is None else argv)]
        ),
    }
    out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out} and {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
