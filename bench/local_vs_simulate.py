"""Wall time per iteration: `mdgan local` (real gRPC on loopback) against `mdgan simulate`.

    python bench/local_vs_simulate.py --workers 4 --batch-size 10 --iterations 300

Both runs use the same flags and seed; the script checks that they end with the same generator
and prints seconds per iteration (training loop only, start-up excluded) and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(mode: str, flags: list[str], out: str) -> dict:
    subprocess.run([sys.executable, "-m", "mdgan.cli", mode, *flags, "--out", out, "--no-progress"], cwd=REPO,
                   check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out, "summary.json")) as fh:
        return json.load(fh)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--kappa", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--swap-every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dataset", default="mnist")
    parser.add_argument("--data-root", default=os.path.join(os.path.dirname(REPO), "shared", "data"))
    args = parser.parse_args()
    flags = ["--workers", str(args.workers), "--batch-size", str(args.batch_size), "--kappa", str(args.kappa),
             "--iterations", str(args.iterations), "--swap-every", str(args.swap_every), "--seed", str(args.seed),
             "--dataset", args.dataset, "--data-root", args.data_root]
    with tempfile.TemporaryDirectory() as tmp:
        sim = run("simulate", flags, os.path.join(tmp, "simulate"))
        local = run("local", flags, os.path.join(tmp, "local"))
    same = sim["generator_sha256"] == local["generator_sha256"]
    print(f"N={args.workers} b={args.batch_size} kappa={args.kappa} I={args.iterations} swaps={local['swaps']} "
          f"(every {args.swap_every}), {os.cpu_count()} cores")
    print(f"simulate: {1000 * sim['seconds_per_iteration']:.2f} ms/iteration ({sim['wall_seconds']:.1f} s)")
    print(f"local:    {1000 * local['seconds_per_iteration']:.2f} ms/iteration ({local['wall_seconds']:.1f} s)")
    print(f"local / simulate: {local['seconds_per_iteration'] / sim['seconds_per_iteration']:.2f}x")
    wire = local.get("message_bytes", {})
    for direction, payload in local["payload_bytes"].items():
        if payload:
            print(f"{direction}: payload {payload} B, serialized {wire.get(direction, 0)} B "
                  f"(+{100 * (wire.get(direction, 0) / payload - 1):.2f}%)")
    print(f"same generator: {same} ({local['generator_sha256'][:16]})")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
