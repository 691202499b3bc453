"""Updates of G per second with one straggler: --sync all against quorum and async, in one invocation.

    python bench/straggler.py --workers 4 --slow-factor 5 --iterations 300

Starts mdgan-server and N mdgan-worker processes on loopback for each mode in turn (the last worker
runs with --slow-factor F: every iteration takes it F times as long), the same flags and seed
otherwise, and prints each mode's G updates per second (training loop only), its ratio to `all`
measured in this same invocation, the answers dropped as late, and the final MNIST score and FID.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(mode: list[str], args, out: str) -> dict:
    os.makedirs(out, exist_ok=True)
    port_file = os.path.join(out, "server.port")
    common = ["--workers", str(args.workers), "--batch-size", str(args.batch_size), "--kappa", str(args.kappa),
              "--iterations", str(args.iterations), "--swap-every", str(args.swap_every), "--seed", str(args.seed)]
    logs = open(os.path.join(out, "processes.log"), "w")
    server = subprocess.Popen([sys.executable, "-m", "services.server", "--listen", "127.0.0.1:0", "--port-file",
                               port_file, "--out", out, "--threads", "1", "--metrics-port", "0", "--dataset", "mnist",
                               "--eval-data-root", args.data_root, "--eval-every", "0", *common, *mode],
                              cwd=REPO, stdout=logs, stderr=subprocess.STDOUT)
    while not os.path.exists(port_file):
        if server.poll() is not None:
            raise SystemExit(f"the server exited; see {out}/processes.log")
        time.sleep(0.05)
    port = open(port_file).read().strip()
    workers = [subprocess.Popen([sys.executable, "-m", "services.worker", "--server", f"127.0.0.1:{port}",
                                 "--listen", "127.0.0.1:0", "--advertise-address", "127.0.0.1",
                                 "--shard-index", str(i), "--num-shards", str(args.workers), "--threads", "1",
                                 "--metrics-port", "0", "--data-root", args.data_root,
                                 *(["--slow-factor", str(args.slow_factor)] if i == args.workers - 1 else [])],
                                cwd=REPO, stdout=logs, stderr=subprocess.STDOUT) for i in range(args.workers)]
    try:
        if server.wait(3600) != 0:
            raise SystemExit(f"the server failed; see {out}/processes.log")
    finally:
        for p in [server, *workers]:
            if p.poll() is None:
                p.kill()
                p.wait()
    with open(os.path.join(out, "summary.json")) as fh:
        summary = json.load(fh)
    with open(os.path.join(out, "history.jsonl")) as fh:
        summary["late"] = sum(json.loads(line).get("late", 0) for line in fh if line.strip())
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--slow-factor", type=float, default=5.0)
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--kappa", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--swap-every", type=int, default=100)
    parser.add_argument("--quorum", type=int, default=0, help="0: N - 1")
    parser.add_argument("--max-staleness", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-root", default=os.path.join(os.path.dirname(REPO), "shared", "data"))
    args = parser.parse_args()
    modes = {"all": ["--sync", "all"], "quorum": ["--sync", "quorum", "--quorum", str(args.quorum)],
             "async": ["--sync", "async", "--max-staleness", str(args.max_staleness)]}
    print(f"N={args.workers} (worker-{args.workers - 1} {args.slow_factor}x slower) b={args.batch_size} "
          f"kappa={args.kappa} I={args.iterations} swap every {args.swap_every}, {os.cpu_count()} cores")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in modes.items():
            results[name] = run(flags, args, os.path.join(tmp, name))
    base = results["all"]["iterations"] / results["all"]["wall_seconds"]
    for name, s in results.items():
        rate = s["iterations"] / s["wall_seconds"]
        scores = s.get("scores") or {}
        print(f"{name:7} {rate:7.2f} updates/s  x{rate / base:.2f} of all  late answers dropped: {s['late']:5d}  "
              f"MNIST score {scores.get('mnist_score', float('nan')):.3f}  FID {scores.get('fid', float('nan')):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
