"""One straggler among N workers: --sync all against quorum and async, in one invocation.

    python bench/straggler.py --workers 4 --slow-factor 5 --iterations 300        # G updates per second
    python bench/straggler.py --workers 4 --slow-factor 5 --wall-budget 420       # scores after equal wall time
    sudo python bench/straggler.py --workers 4 --netns-rate 2mbit --wall-budget 300   # a real slow link

Starts mdgan-server and N mdgan-worker processes for each mode in turn, the same flags and seed
otherwise. The last worker is the straggler, one of two kinds:

- `--slow-factor F`: emulated, every iteration takes it F times as long (mdgan-worker --slow-factor);
- `--netns-rate RATE`: real, it runs in a network namespace whose only link to the host is a veth
  pair shaped by `tc ... tbf rate RATE` on both ends (bench/netns.py says how, step by step, to do it
  by hand), so every byte it receives (generated batches, a swapped discriminator) and sends
  (feedback, its discriminator) crosses a RATE link while the other workers talk over loopback.
  Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN); `ip` and `tc` from iproute2.

Two measures:

- `--iterations I` (default): every mode trains I iterations; prints its G updates per second
  (training loop only) and the ratio to `all` measured in this same invocation, the answers dropped as
  late, and the final MNIST score and FID.
- `--wall-budget S`: every mode trains S seconds (the sum of its iterations' wall times from the
  second on: start-up and the first iteration, the workers' warm-up, excluded), then the server gets
  SIGTERM, checkpoints the iteration under way and stops; the bench scores that checkpoint's generator
  (MNIST score and FID, --eval-samples images against 2,000 MNIST test images, the same fixed noise
  for every mode). This is the comparison that matters: what each
  mode has learnt after the same time, not how many (smaller, staler) updates it made.

A timing measurement: run it on a quiet machine, or niced and with the load average stated; compare
only ratios from one invocation. The modes run one after another, so a load that changes meanwhile
biases them; `--order` changes which goes first.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from netns import ShapedNamespace, why_not_available  # noqa: E402
from processes import kill_all  # noqa: E402

FOREVER = 1_000_000  # --iterations under a wall budget: the budget stops the run


def training_seconds(history: str, upto: int = FOREVER) -> tuple[int, float]:
    """(iterations after the first, the sum of their wall times) so far, from the server's
    history.jsonl. The first iteration is left out: it holds every worker's warm-up (their first
    step; 15 to 30 s on a loaded machine), which says nothing about the mode."""
    if not os.path.exists(history):
        return 0, 0.0
    iterations, seconds = 0, 0.0
    with open(history) as fh:
        for line in fh:
            if line.endswith("\n"):
                row = json.loads(line)
                if 1 < row["iteration"] <= upto:
                    iterations, seconds = iterations + 1, seconds + row["seconds"]
    return iterations, seconds


def score_checkpoint(out: str, args) -> dict:
    """MNIST score and FID of the generator in the server's newest checkpoint under `out`."""
    import torch

    from mdgan.config import TrainingConfig
    from mdgan.gan import GeneratorSide
    from mdgan.run import make_evaluator

    folders = sorted(glob.glob(os.path.join(out, "checkpoints", "*", "server.pt")))
    if not folders:
        raise SystemExit(f"no checkpoint under {out}; see {out}/processes.log")
    state = torch.load(folders[-1], map_location="cpu", weights_only=False)  # our own file, just written
    config = TrainingConfig(workers=args.workers, iterations=state["iteration"], batch_size=args.batch_size,
                            kappa=args.kappa, seed=args.seed).validate()
    side = GeneratorSide(config)
    side.generator.load_state_dict(state["generator_side"]["generator"])
    evaluator = make_evaluator(side, args.data_root, 0, args.eval_samples, 2000)
    return {"iteration": state["iteration"], **evaluator.finish(state["iteration"])[-1]}


def run(mode: list[str], args, out: str, namespace: ShapedNamespace | None) -> dict:
    os.makedirs(out, exist_ok=True)
    port_file = os.path.join(out, "server.port")
    iterations = FOREVER if args.wall_budget else args.iterations
    common = ["--workers", str(args.workers), "--batch-size", str(args.batch_size), "--kappa", str(args.kappa),
              "--iterations", str(iterations), "--swap-every", str(args.swap_every), "--seed", str(args.seed)]
    budget = ["--checkpoint-every", str(FOREVER), "--eval-every", "-1"] if args.wall_budget else ["--eval-every", "0"]
    # with a namespace, everyone listens on every address: the straggler reaches the host at host_ip
    host = "0.0.0.0" if namespace else "127.0.0.1"
    advertise = namespace.host_ip if namespace else "127.0.0.1"
    logs = open(os.path.join(out, "processes.log"), "w")
    server = subprocess.Popen([sys.executable, "-m", "services.server", "--listen", f"{host}:0", "--port-file",
                               port_file, "--out", out, "--threads", "1", "--metrics-port", "0", "--dataset", "mnist",
                               "--eval-data-root", args.data_root, "--insecure", *budget, *common, *mode],
                              cwd=REPO, stdout=logs, stderr=subprocess.STDOUT)
    workers = []
    try:
        while not os.path.exists(port_file):
            if server.poll() is not None:
                raise SystemExit(f"the server exited; see {out}/processes.log")
            time.sleep(0.05)
        port = open(port_file).read().strip()
        for i in range(args.workers):
            straggler = i == args.workers - 1
            command = [sys.executable, "-m", "services.worker", "--shard-index", str(i),
                       "--num-shards", str(args.workers), "--threads", "1", "--metrics-port", "0",
                       "--data-root", args.data_root, "--insecure"]  # plaintext on a private link
            if straggler and namespace:
                command = namespace.wrap([*command, "--server", f"{namespace.host_ip}:{port}",
                                          "--listen", "0.0.0.0:0", "--advertise-address", namespace.ns_ip])
            else:
                command += ["--server", f"127.0.0.1:{port}", "--listen", f"{host}:0", "--advertise-address", advertise]
                if straggler:
                    command += ["--slow-factor", str(args.slow_factor)]
            workers.append(subprocess.Popen(command, cwd=REPO, stdout=logs, stderr=subprocess.STDOUT))
        history = os.path.join(out, "history.jsonl")
        load_before = os.getloadavg()[0]
        shaped_before = namespace.bytes_shaped() if namespace else (0, 0)
        if args.wall_budget:
            while server.poll() is None and training_seconds(history)[1] < args.wall_budget:
                time.sleep(0.5)
            if server.poll() is not None:
                raise SystemExit(f"the server stopped before the budget; see {out}/processes.log")
            server.send_signal(signal.SIGTERM)  # checkpoint the iteration under way, then stop
            server.wait(300)
            scored = score_checkpoint(out, args)  # the checkpoint's iteration: what was scored
            summary = {"scored_iteration": scored["iteration"],
                       "scores": {k: scored[k] for k in ("mnist_score", "fid")}}
            summary["iterations"], summary["wall_seconds"] = training_seconds(history, scored["iteration"])
        else:
            if server.wait(3600) != 0:
                raise SystemExit(f"the server failed; see {out}/processes.log")
            with open(os.path.join(out, "summary.json")) as fh:
                summary = json.load(fh)
        summary["load"] = (load_before, os.getloadavg()[0])
        if namespace:  # what crossed the straggler's link in this mode (in, out)
            summary["shaped_bytes"] = [b - a for a, b in zip(shaped_before, namespace.bytes_shaped())]
    finally:
        kill_all([server, *workers])
        logs.close()
    with open(os.path.join(out, "history.jsonl")) as fh:
        rows = [json.loads(line) for line in fh if line.endswith("\n")]
    last = summary.get("scored_iteration", summary["iterations"])
    summary["late"] = sum(row.get("late", 0) for row in rows if row["iteration"] <= last)
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--slow-factor", type=float, default=5.0, help="the emulated straggler's slow-down")
    parser.add_argument("--netns-rate", default=None,
                        help="instead: put the straggler behind a real link of this rate (tc tbf syntax: 2mbit)")
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--kappa", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--wall-budget", type=float, default=0.0,
                        help="instead of --iterations: every mode trains this many seconds, then is scored")
    parser.add_argument("--eval-samples", type=int, default=500)
    parser.add_argument("--swap-every", type=int, default=100)
    parser.add_argument("--quorum", type=int, default=0, help="0: N - 1")
    parser.add_argument("--max-staleness", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--order", default="all,quorum,async", help="the modes, in the order they run")
    parser.add_argument("--keep", default=None, help="keep every mode's run directory under this folder")
    parser.add_argument("--data-root", default=os.path.join(os.path.dirname(REPO), "shared", "data"))
    args = parser.parse_args()
    flags = {"all": ["--sync", "all"], "quorum": ["--sync", "quorum", "--quorum", str(args.quorum)],
             "async": ["--sync", "async", "--max-staleness", str(args.max_staleness)]}
    order = args.order.split(",")
    if sorted(order) != sorted(flags):
        raise SystemExit(f"--order: a permutation of {','.join(flags)}")
    if args.netns_rate:
        reason = why_not_available()
        if reason:
            raise SystemExit(f"--netns-rate: {reason}")
    straggler = f"behind a {args.netns_rate} link (netns + tc tbf)" if args.netns_rate else \
        f"{args.slow_factor}x slower (--slow-factor)"
    length = f"{args.wall_budget:g} s of training each" if args.wall_budget else f"I={args.iterations}"
    print(f"N={args.workers} (worker-{args.workers - 1} {straggler}) b={args.batch_size} kappa={args.kappa} "
          f"{length}, swap every {args.swap_every}, quorum {args.quorum or args.workers - 1}, "
          f"max staleness {args.max_staleness}; {os.cpu_count()} cores", flush=True)
    results = {}
    with contextlib.ExitStack() as stack:
        root = args.keep or stack.enter_context(tempfile.TemporaryDirectory())
        namespace = stack.enter_context(ShapedNamespace(args.netns_rate)) if args.netns_rate else None
        for name in order:
            results[name] = run(flags[name], args, os.path.join(root, name), namespace)
            s = results[name]
            link = f", {s['shaped_bytes'][0]:,} B in / {s['shaped_bytes'][1]:,} B out through the straggler's " \
                "link" if namespace else ""
            print(f"  {name} done: {s['iterations']} iterations in {s['wall_seconds']:.1f} s, load average "
                  f"{s['load'][0]:.1f} -> {s['load'][1]:.1f}{link}", flush=True)
    base = results["all"]["iterations"] / results["all"]["wall_seconds"]
    for name, s in results.items():
        rate = s["iterations"] / s["wall_seconds"]
        scores = s.get("scores") or {}
        print(f"{name:7} {s.get('scored_iteration', s['iterations']):6d} it ({s['iterations']} timed, "
              f"{s['wall_seconds']:.1f} s) {rate:7.2f} updates/s  "
              f"x{rate / base:.2f} of all  late answers dropped: {s['late']:5d}  "
              f"MNIST score {scores.get('mnist_score', float('nan')):.3f}  FID {scores.get('fid', float('nan')):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
