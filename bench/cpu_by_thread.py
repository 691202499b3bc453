"""CPU per iteration of a running `mdgan local` (or `mdgan simulate`), by process and thread, from /proc.

    python bench/cpu_by_thread.py --mode local --workers 4 --kappa 1 --seconds 12
    python bench/cpu_by_thread.py --mode simulate --workers 4 --kappa 1 --seconds 12
    python bench/cpu_by_thread.py --mode local --swap-every 5      # what swaps cost: against --swap-every 0

py-spy's shares are of wall-clock samples of threads that are not blocked: a thread that is
runnable but waits for a core (most of the time on a loaded machine) counts as busy wherever it was
preempted, typically right after a socket write woke its peer. This counts what the kernel charged:
user and system time of each thread over a window of a running cluster (after 100 iterations),
per iteration. Threads: `main` (the event loop and the arithmetic), `event_engine` (gRPC's I/O
threads), `python` (other Python threads: gRPC's completion-queue poller, the metrics server).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fifty_workers import REPO, tree  # noqa: E402
from local_vs_simulate import TICK, lines, run_flags  # noqa: E402
from profile_local import role_of  # noqa: E402


def snapshot(root: int) -> dict[tuple[str, str, str], float]:
    """(process role, thread kind, user|system) -> CPU seconds, summed over the tree."""
    out: dict[tuple[str, str, str], float] = {}
    for pid in tree(root):
        role = role_of(pid) or ("launcher" if pid == root else "other")
        role = "workers" if role.startswith(("worker-", "workers-")) else role  # a process of one or several
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as fh:
                    stat = fh.read()
            except OSError:
                continue
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            kind = "main" if tid == str(pid) else name
            fields = stat.rsplit(")", 1)[1].split()
            for column, which in ((11, "user"), (12, "system")):
                key = (role, kind, which)
                out[key] = out.get(key, 0.0) + int(fields[column]) / TICK
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("local", "simulate"), default="local")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--kappa", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=12)
    parser.add_argument("--swap-every", type=int, default=100,
                        help="iterations between swaps (0: none in the window); the CPU of a swap round is "
                             "the difference per iteration times this")
    parser.add_argument("--data-root", default=os.path.join(os.path.dirname(REPO), "shared", "data"))
    parser.add_argument("--out", default=None, help="run directory (default: a temporary one)")
    args = parser.parse_args()
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = args.out or os.path.join(tmp, "run")
        process = subprocess.Popen([sys.executable, "-m", "mdgan_app.cli", args.mode,
                                    *run_flags(args.workers, args.kappa, 100000, args.data_root, args.batch_size,
                                              args.swap_every or 100000),
                                    "--no-progress", "--out", run_dir], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   start_new_session=True)
        try:
            history = os.path.join(run_dir, "history.jsonl")
            while lines(history) < 100:
                if process.poll() is not None:
                    raise SystemExit(f"mdgan {args.mode} exited with {process.returncode}")
                time.sleep(0.2)
            with open("/proc/loadavg") as fh:
                load = fh.read().split()[0]
            before, done_before = snapshot(process.pid), lines(history)
            time.sleep(args.seconds)
            after, done = snapshot(process.pid), lines(history) - done_before
        finally:
            os.killpg(process.pid, 15)
            process.wait(60)
    per_iteration = {k: 1000 * (v - before.get(k, 0.0)) / max(1, done) for k, v in after.items()}
    print(f"mdgan {args.mode} N={args.workers} kappa={args.kappa}: {done} iterations in {args.seconds:.0f} s "
          f"(load average {load}); ms of CPU per iteration:")
    rows: dict[tuple[str, str], tuple[float, float]] = {}
    for (role, kind, which), ms in per_iteration.items():
        user, system = rows.get((role, kind), (0.0, 0.0))
        rows[(role, kind)] = (user + ms, system) if which == "user" else (user, system + ms)
    for (role, kind), (user, system) in sorted(rows.items(), key=lambda r: -sum(r[1])):
        if user + system > 0.005:
            print(f"  {role:9} {kind:14} {user + system:7.2f}  (user {user:6.2f}, system {system:5.2f})")
    print(f"  total {sum(per_iteration.values()):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
