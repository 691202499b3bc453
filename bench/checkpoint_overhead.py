"""What checkpoints cost: seconds per iteration with --checkpoint-every against without, same run.

    python bench/checkpoint_overhead.py --workers 10 --iterations 300 --checkpoint-every 100

Runs `mdgan local` (real gRPC on loopback; every worker writes its own state, in parallel) with and
without checkpoints, alternating, `--repeats` times each, on the same flags and seed. Checks that
both end with the same generator (checkpoints change nothing in training) and prints the seconds per
iteration (training loop only: start-up excluded), the ratio, the cost of one checkpoint and the
bytes one checkpoint writes (server + workers).
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
    subprocess.run([sys.executable, "-m", "mdgan.cli", "local", *flags, "--out", out, "--no-progress"], cwd=REPO,
                   check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out, "summary.json")) as fh:
        return json.load(fh)


def checkpoint_bytes(out: str, iteration: int) -> int:
    """Bytes of the server's and every worker's files for one checkpoint."""
    total = 0
    for root, _, files in os.walk(out):
        if os.path.basename(root) == f"{iteration:09d}":
            total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


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
    shas = set()
    with tempfile.TemporaryDirectory(prefix="mdgan-ckpt-bench-") as tmp:
        for r in range(args.repeats):
            for name, extra in (("none", []), ("checkpoints", ["--checkpoint-every", str(args.checkpoint_every)])):
                summary = run(flags + extra, os.path.join(tmp, f"{name}-{r}"))
                seconds[name].append(summary["seconds_per_iteration"])
                shas.add(summary["generator_sha256"])
        written = checkpoint_bytes(os.path.join(tmp, "checkpoints-0"), args.checkpoint_every)
    base, with_ckpt = statistics.median(seconds["none"]), statistics.median(seconds["checkpoints"])
    count = (args.iterations - 1) // args.checkpoint_every  # none at the last iteration (the outputs are written)
    report = {
        "workers": args.workers, "iterations": args.iterations, "checkpoint_every": args.checkpoint_every,
        "seconds_per_iteration": {"no_checkpoints": base, "with_checkpoints": with_ckpt},
        "runs": seconds,
        "ratio": with_ckpt / base,
        "overhead_per_iteration_seconds": with_ckpt - base,
        "seconds_per_checkpoint": (with_ckpt - base) * args.iterations / count if count else None,
        "bytes_per_checkpoint": written,
        "same_generator": len(shas) == 1,
    }
    print(json.dumps(report, indent=2))
    return 0 if len(shas) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
