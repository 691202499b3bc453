"""What checkpoints cost: seconds per iteration with --checkpoint-every against without, same run.

    python bench/checkpoint_overhead.py --workers 10 --iterations 300 --checkpoint-every 100

Runs `mdgan local` (real gRPC on loopback; every worker writes its own state, in parallel) with and
without checkpoints, alternating, `--repeats` times each, on the same flags and seed. Checks that
both end with the same generator (checkpoints change nothing in training) and prints:
- the seconds per iteration of both (training loop only: start-up excluded) and their ratio;
- what each checkpoint cost, timed by the server (order to every worker, their writes, the server's
  own write: the `seconds` of each COMPLETE marker), spread over the iterations: the overhead per
  iteration and its ratio to the run without checkpoints (less noisy on a shared machine);
- the bytes of one checkpoint (server's file, plus N times a worker's state).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(flags: list[str], out: str) -> dict:
    subprocess.run([sys.executable, "-m", "mdgan_app.cli", "local", *flags, "--out", out, "--no-progress"], cwd=REPO,
                   check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out, "summary.json")) as fh:
        return json.load(fh)


def checkpoint_costs(out: str) -> tuple[list[float], int]:
    """(seconds of every complete checkpoint, bytes of the server's file of the first one)."""
    root = os.path.join(out, "checkpoints")
    seconds, size = [], 0
    for name in sorted(os.listdir(root)):
        with open(os.path.join(root, name, "COMPLETE")) as fh:
            seconds.append(json.load(fh)["seconds"])
        size = size or os.path.getsize(os.path.join(root, name, "server.pt"))
    return seconds, size


def worker_state_bytes(workers: int, batch_size: int) -> int:
    """Bytes of one worker's saved state (D, Adam after a step, sampler) for the MNIST MLP."""
    import io

    import torch

    from mdgan.config import DataConfig, TrainingConfig
    from mdgan.data import load_shard
    from mdgan.gan import DiscriminatorSide, GeneratedBatches

    config = TrainingConfig(workers=workers, batch_size=batch_size).validate()
    side = DiscriminatorSide(config, load_shard(DataConfig("synthetic", num_shards=workers), 0))
    fake = torch.zeros(1, batch_size, 784)
    side.step(GeneratedBatches(fake, torch.zeros(1, batch_size, dtype=torch.long)).for_worker(0))
    buffer = io.BytesIO()
    torch.save(side.state_dict(), buffer)
    return buffer.tell()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dataset", default="mnist")
    parser.add_argument("--data-root", default=os.path.join(os.path.dirname(REPO), "shared", "data"))
    args = parser.parse_args()
    flags = ["--workers", str(args.workers), "--batch-size", str(args.batch_size), "--iterations",
             str(args.iterations), "--architecture", "mlp", "--dataset", args.dataset, "--data-root", args.data_root,
             "--eval-every", "-1", "--keep-checkpoints", "100"]
    seconds = {"none": [], "checkpoints": []}
    shas, costs, server_bytes = set(), [], 0
    with tempfile.TemporaryDirectory(prefix="mdgan-ckpt-bench-") as tmp:
        for r in range(args.repeats):
            for name, extra in (("none", []), ("checkpoints", ["--checkpoint-every", str(args.checkpoint_every)])):
                summary = run(flags + extra, os.path.join(tmp, f"{name}-{r}"))
                seconds[name].append(summary["seconds_per_iteration"])
                shas.add(summary["generator_sha256"])
                if extra:
                    found, server_bytes = checkpoint_costs(os.path.join(tmp, f"{name}-{r}"))
                    costs += found
    base, with_ckpt = statistics.median(seconds["none"]), statistics.median(seconds["checkpoints"])
    count = (args.iterations - 1) // args.checkpoint_every  # none at the last iteration (the outputs are written)
    per_checkpoint = statistics.median(costs) if costs else None
    timed_overhead = per_checkpoint * count / args.iterations if costs else None
    report = {
        "workers": args.workers, "iterations": args.iterations, "checkpoint_every": args.checkpoint_every,
        "seconds_per_iteration": {"no_checkpoints": base, "with_checkpoints": with_ckpt},
        "runs": seconds,
        "ratio_wall": with_ckpt / base,
        "seconds_per_checkpoint_timed": per_checkpoint,
        "checkpoints_timed": costs,
        "overhead_per_iteration_timed": timed_overhead,
        "ratio_timed": (base + timed_overhead) / base if costs else None,
        "bytes_per_checkpoint": server_bytes + args.workers * worker_state_bytes(args.workers, args.batch_size),
        "same_generator": len(shas) == 1,
    }
    print(json.dumps(report, indent=2))
    return 0 if len(shas) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
