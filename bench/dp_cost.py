"""What DP-SGD costs a run: seconds an iteration of `mdgan simulate` with DP-SGD discriminators (the generated
part clipped, the default, and unclipped) against the same run without DP, in one invocation (docs/PRIVACY.md, "Differentially private discriminators").

    python bench/dp_cost.py                        # MNIST, MLP ACGAN, N = 10, b = 10, 300 iterations
    python bench/dp_cost.py --workers 4 --batch-size 50 --iterations 200 --device cuda

Each run is its own `mdgan simulate` process with one torch thread and no evaluation; the time is its
summary's seconds_per_iteration (training only). Run it on a quiet machine: the ratio is the figure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def seconds_per_iteration(args, out: str, private: list[str]) -> float:
    command = [sys.executable, "-m", "mdgan_app.cli", "simulate", "--data-root", args.data_root,
               "--architecture", "mlp", "--gan", "acgan", "--workers", str(args.workers),
               "--batch-size", str(args.batch_size), "--iterations", str(args.iterations),
               "--eval-every", "-1", "--threads", "1", "--device", args.device, "--no-progress", "--out", out,
               *private]
    subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out, "summary.json")) as fh:
        return json.load(fh)["seconds_per_iteration"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--epsilon", type=float, default=10.0, help="DP-SGD's target epsilon per site")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--data-root", default=os.path.join(os.path.dirname(REPO), "shared", "data"))
    args = parser.parse_args()
    dp = ["--dp-target-epsilon", str(args.epsilon)]
    with tempfile.TemporaryDirectory(prefix="mdgan-dp-cost-") as tmp:
        plain = seconds_per_iteration(args, os.path.join(tmp, "plain"), [])
        private = seconds_per_iteration(args, os.path.join(tmp, "dp"), dp)
        unclipped = seconds_per_iteration(args, os.path.join(tmp, "dp-unclipped"), [*dp, "--no-dp-clip-generated"])
    print(f"N = {args.workers}, b = {args.batch_size}, {args.iterations} iterations on {args.device}: "
          f"without DP {plain:.4f} s an iteration; DP-SGD (epsilon {args.epsilon:g}) {private:.4f} s: "
          f"{private / plain:.2f}x; with the generated part unclipped (--no-dp-clip-generated) {unclipped:.4f} s: "
          f"{unclipped / plain:.2f}x")


if __name__ == "__main__":
    main()
