"""Start-up and memory of a big local cluster: `mdgan local --workers 50` (MNIST MLP, b=10, kappa=5).

    python bench/fifty_workers.py --workers 50 --kappa 5 --iterations 40

Prints the seconds from the command to the first finished iteration, the peak memory of the whole
process tree (the sum of every process's PSS, so pages shared copy-on-write count once) and the
peak drop of the machine's MemAvailable (noisy on a shared machine), and workers_alive at the end.
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


def tree(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [pid], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def pss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as fh:
                for line in fh:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
        except OSError:
            pass
    return total


def mem_available() -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def measure(flags: list[str], out: str, sample_every: float = 0.5) -> dict:
    idle = mem_available()
    started = time.monotonic()
    launcher = subprocess.Popen([sys.executable, "-m", "mdgan_app.cli", "local", *flags, "--out", out, "--no-progress"],
                                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    history = os.path.join(out, "history.jsonl")
    first_iteration = None
    peak_pss = peak_drop = 0
    peak_processes = 0
    while launcher.poll() is None:
        pids = tree(launcher.pid)
        peak_processes = max(peak_processes, len(pids))
        peak_pss = max(peak_pss, pss_bytes(pids))
        peak_drop = max(peak_drop, idle - mem_available())
        if first_iteration is None and os.path.exists(history) and os.path.getsize(history) > 0:
            first_iteration = time.monotonic() - started
        time.sleep(sample_every)
    stdout, stderr = launcher.communicate()
    if launcher.returncode != 0:
        raise SystemExit(f"mdgan local failed ({launcher.returncode}):\n{stderr[-3000:]}")
    with open(os.path.join(out, "summary.json")) as fh:
        summary = json.load(fh)
    return {"first_iteration_s": first_iteration, "total_s": time.monotonic() - started, "peak_pss": peak_pss,
            "peak_available_drop": peak_drop, "processes": peak_processes, "summary": summary}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=50)
    parser.add_argument("--kappa", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--data-root", default=os.path.join(os.path.dirname(REPO), "shared", "data"))
    parser.add_argument("--workers-per-process", type=int, default=0,
                        help="mdgan local's --workers-per-process (0, its default: one worker process per core)")
    args = parser.parse_args()
    flags = ["--workers", str(args.workers), "--kappa", str(args.kappa), "--batch-size", str(args.batch_size),
             "--iterations", str(args.iterations), "--dataset", "mnist", "--data-root", args.data_root,
             "--eval-every", "-1", "--workers-per-process", str(args.workers_per_process)]
    with tempfile.TemporaryDirectory() as tmp:
        r = measure(flags, os.path.join(tmp, "run"))
    s = r["summary"]
    print(f"mdgan local --workers {args.workers} --kappa {args.kappa} -b {args.batch_size} --iterations "
          f"{args.iterations} --workers-per-process {args.workers_per_process} (MNIST MLP), {os.cpu_count()} cores")
    print(f"first iteration {r['first_iteration_s']:.1f} s after the command; whole run {r['total_s']:.1f} s")
    print(f"peak memory of the cluster: {r['peak_pss'] / 2**30:.2f} GiB PSS over {r['processes']} processes "
          f"({r['peak_pss'] / 2**20 / max(1, r['processes']):.0f} MiB each); MemAvailable fell by at most "
          f"{r['peak_available_drop'] / 2**30:.2f} GiB")
    print(f"{1000 * s['seconds_per_iteration']:.1f} ms/iteration; workers_alive {s['workers_alive']} of {s['workers']}")
    return 0 if s["workers_alive"] == args.workers else 1


if __name__ == "__main__":
    sys.exit(main())
