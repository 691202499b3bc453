"""Why DP-SGD discriminators end calling every real image fake: one `mdgan simulate` run with DP-SGD
discriminators, and every E iterations a look at site 0's D just before it trains (docs/PRIVACY.md, "The
discriminators' collapse").

    python bench/dp_collapse.py                                   # b = 200, epsilon 10, 1,000 iterations
    python bench/dp_collapse.py --every 50 -- --disc-steps 3      # any further `mdgan simulate` flags after --

At each look, over 64 real images of the site (the same ones each time) and 64 of the generated batch it is
about to train on: the mean real/fake logit, and each sample's gradient norm (the whole loss, and its real/fake
term alone), with C's clipping factor min(1, C / norm); "push" is what the clipped samples of each kind
move the real/fake output's bias by, on average: the real part up, the generated part down. The run itself is
the one `mdgan simulate` would train (a look draws no random numbers and leaves D's .grad alone). Prints a table;
--json writes the looks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from mdgan import gan  # noqa: E402
from mdgan.gan import discriminator_term  # noqa: E402

LOOKED = 64


def _norm(tensors) -> torch.Tensor:
    """The L2 norm of a list of tensors taken as one vector, in float64."""
    return torch.sqrt(sum((t.detach().double() ** 2).sum() for t in tensors))


def per_sample_norms(disc: torch.nn.Module, spec, images: torch.Tensor, labels: torch.Tensor | None, real: bool):
    """Each sample's gradient norm over D's parameters, of its whole loss and of its real/fake term: (n,), (n,),
    and the bias gradient of the real/fake logit, (n,) (= sigmoid(l) - 1 real, sigmoid(l) generated)."""
    parameters = [p for p in disc.parameters() if p.requires_grad]
    whole, source, bias = [], [], []
    for i in range(len(images)):
        logits = disc(images[i:i + 1])  # (1, 1 [+ C])
        loss = discriminator_term(spec, logits, None if labels is None else labels[i:i + 1], real=real)
        whole.append(_norm(torch.autograd.grad(loss, parameters, retain_graph=True)))
        term = F.binary_cross_entropy_with_logits(logits[:, 0], torch.full((1,), 1.0 if real else 0.0))
        source.append(_norm(torch.autograd.grad(term, parameters)))
        bias.append(torch.sigmoid(logits[0, 0].detach()).double() - (1.0 if real else 0.0))
    return torch.stack(whole), torch.stack(source), torch.stack(bias)


def look(side, fake: torch.Tensor, fake_labels: torch.Tensor | None, iteration: int, clip: float) -> dict:
    disc, spec = side.discriminator, side.spec
    shard = side.sampler.shard
    real, real_labels = shard.images[:LOOKED], shard.labels[:LOOKED]
    fake, fake_labels = fake[:LOOKED], None if fake_labels is None else fake_labels[:LOOKED]
    with torch.no_grad():
        real_logit = disc(real)[:, 0].double()
        fake_logit = disc(fake)[:, 0].double()
    row = {"iteration": iteration, "real_logit": real_logit.mean().item(), "fake_logit": fake_logit.mean().item(),
           "real_accuracy": (real_logit > 0).double().mean().item(),
           "fake_accuracy": (fake_logit <= 0).double().mean().item(),
           "weight_norm": _norm(list(disc.parameters())).item()}
    for kind, images, labels in (("real", real, real_labels), ("fake", fake, fake_labels)):
        whole, source, bias = per_sample_norms(disc, spec, images, labels, real=kind == "real")
        factor = torch.clamp(clip / whole, max=1.0)
        row[f"{kind}_norm"] = whole.mean().item()
        row[f"{kind}_source_norm"] = source.mean().item()
        row[f"{kind}_clipped"] = (whole > clip).double().mean().item()
        row[f"{kind}_push"] = (-(bias * factor)).mean().item()  # + moves the bias up (towards "real")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every", type=int, default=25, help="look every this many iterations")
    parser.add_argument("--site", type=int, default=0)
    parser.add_argument("--json", help="write the looks here")
    parser.add_argument("--data-root", default=os.path.join(os.path.dirname(REPO), "shared", "data"))
    parser.add_argument("simulate", nargs=argparse.REMAINDER, help="-- then further `mdgan simulate` flags")
    args = parser.parse_args()
    extra = [a for a in args.simulate if a != "--"]
    rows: list[dict] = []
    calls = {"n": 0}
    original = gan.DiscriminatorSide.private_disc_steps

    def watched(self, fake, fake_labels):
        if self.shard_index == args.site:
            if calls["n"] % args.every == 0:
                rows.append(look(self, fake, fake_labels, calls["n"], self.private.site.max_grad_norm))
                print(" ".join(f"{k}={v:.4g}" for k, v in rows[-1].items()), flush=True)
            calls["n"] += 1
        return original(self, fake, fake_labels)

    gan.DiscriminatorSide.private_disc_steps = watched
    from mdgan_app.cli import main as cli

    with tempfile.TemporaryDirectory(prefix="mdgan-dp-collapse-") as tmp:
        flags = ["simulate", "--data-root", args.data_root, "--architecture", "mlp", "--gan", "acgan",
                 "--workers", "10", "--batch-size", "200", "--iterations", "1000", "--dp-target-epsilon", "10",
                 "--eval-every", "-1", "--threads", "1", "--no-progress", "--out", os.path.join(tmp, "run"), *extra]
        cli(flags)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"flags": extra, "looks": rows}, fh, indent=1)
    print(table(rows))


COLUMNS = ["iteration", "real_logit", "fake_logit", "real_accuracy", "fake_accuracy", "real_norm", "real_source_norm",
           "fake_norm", "fake_source_norm", "real_clipped", "fake_clipped", "real_push", "fake_push", "weight_norm"]


def table(rows: list[dict]) -> str:
    """The looks as a Markdown table."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    lines += ["| " + " | ".join(f"{row[k]:.4g}" for k in COLUMNS) + " |" for row in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
