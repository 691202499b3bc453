"""Where a running `mdgan local` (or `mdgan simulate`) spends its time: py-spy on its processes.

    python bench/profile_local.py --mode local --workers 4 --kappa 1 --seconds 15 --out /tmp/prof
    python bench/profile_local.py --mode simulate --workers 4 --kappa 1 --seconds 15 --out /tmp/prof

Starts the run (MNIST MLP, b=10, a swap every 100 iterations, TLS and metrics on, like
bench/local_vs_simulate.py), waits until it trains, then records the server and worker-0's process (local)
or the one process (simulate) with `py-spy record --nonblocking --format raw` for --seconds, at
the same time, and prints for each process its CPU over the window, the top frames by self samples
and by inclusive samples (the shares are of the process's non-idle samples, all threads). The raw
profiles (collapsed stacks, flamegraph.pl / speedscope can read them) stay in --out.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fifty_workers import REPO, tree  # noqa: E402
from local_vs_simulate import TICK, lines, run_flags  # noqa: E402


def role_of(pid: int) -> str | None:
    """A service of `mdgan local` writes its output to OUT/logs/NAME.log: NAME."""
    try:
        target = os.readlink(f"/proc/{pid}/fd/1")
    except OSError:
        return None
    if "/logs/" in target and target.endswith(".log"):
        return os.path.basename(target)[:-4]
    return None


def cpu_seconds(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICK
    except (OSError, IndexError, ValueError):
        return 0.0


def summarise(path: str, top: int) -> str:
    """Top frames of a raw (collapsed) py-spy profile: self and inclusive shares of all samples."""
    own, inclusive, total = collections.Counter(), collections.Counter(), 0
    with open(path) as fh:
        for line in fh:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            n = int(count)
            frames = [f.split(" (")[0] + " (" + os.path.basename(f.split(" (")[1].split(":")[0]) + ")" if " (" in f
                      else f for f in stack.split(";")[1:]]  # [0] is the thread
            total += n
            if frames:
                own[frames[-1]] += n
            for frame in set(frames):
                inclusive[frame] += n
    out = [f"  {total} samples"]
    out.append("  self:      " + "; ".join(f"{f} {100 * n / total:.1f}%" for f, n in own.most_common(top)))
    out.append("  inclusive: " + "; ".join(f"{f} {100 * n / total:.1f}%" for f, n in inclusive.most_common(top)))
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("local", "simulate"), default="local")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--kappa", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=15)
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    parser.add_argument("--native", action="store_true", help="native frames too (py-spy --native; blocks the target)")
    parser.add_argument("--top", type=int, default=14)
    parser.add_argument("--data-root", default=os.path.join(os.path.dirname(REPO), "shared", "data"))
    parser.add_argument("--out", required=True, help="folder for the raw profiles")
    args = parser.parse_args()
    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    os.makedirs(args.out, exist_ok=True)
    run_dir = os.path.join(args.out, f"run-{args.mode}-{args.workers}")
    shutil.rmtree(run_dir, ignore_errors=True)
    iterations = 100000  # stopped once profiled
    process = subprocess.Popen([sys.executable, "-m", "mdgan_app.cli", args.mode,
                                *run_flags(args.workers, args.kappa, iterations, args.data_root, args.batch_size),
                                "--no-progress", "--out", run_dir],
                               cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        history = os.path.join(run_dir, "history.jsonl")
        while lines(history) < 100:
            if process.poll() is not None:
                raise SystemExit(f"mdgan {args.mode} exited with {process.returncode}")
            time.sleep(0.2)
        if args.mode == "simulate":
            targets = {"simulate": process.pid}
        else:
            roles = {role_of(pid): pid for pid in tree(process.pid)}
            # worker-0's process: its own, or the one it shares with others (workers-0-J)
            first = "worker-0" if "worker-0" in roles else min(r for r in roles if r and r.startswith("workers-0-"))
            targets = {name: roles[name] for name in ("server", first)}
        before = {name: cpu_seconds(pid) for name, pid in targets.items()}
        done_before, started = lines(history), time.perf_counter()
        spies = {}
        for name, pid in targets.items():
            raw = os.path.join(args.out, f"{args.mode}-N{args.workers}-{name}.txt")
            command = [spy, "record", "--pid", str(pid), "--rate", str(args.rate), "--duration",
                       str(int(args.seconds)), "--format", "raw", "--output", raw, "--threads"]
            command += ["--native"] if args.native else ["--nonblocking"]
            spies[name] = (raw, subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        for raw, spy_process in spies.values():
            spy_process.wait()
        elapsed, done = time.perf_counter() - started, lines(history) - done_before
        print(f"mdgan {args.mode} N={args.workers} kappa={args.kappa}: {done} iterations in {elapsed:.1f} s "
              f"({1000 * elapsed / max(1, done):.1f} ms/iteration while profiled)")
        for name, (raw, spy_process) in spies.items():
            cpu = cpu_seconds(targets[name]) - before[name]
            print(f"{name}: {1000 * cpu / max(1, done):.2f} ms CPU/iteration")
            if spy_process.returncode != 0:
                print(f"  py-spy failed: {spy_process.stderr.read().decode()[-500:]}")
                continue
            print(summarise(raw, args.top))
    finally:
        os.killpg(process.pid, 15)
        process.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
