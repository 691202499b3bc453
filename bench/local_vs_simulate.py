"""`mdgan local` (real gRPC on loopback) against `mdgan simulate` (one process), and a big cluster's start-up.

    python bench/local_vs_simulate.py                      # N=4 (kappa 1) and N=10 (kappa 3), then N=50
    python bench/local_vs_simulate.py --cases 4:1 --repeats 5 --iterations 400 --no-fifty
    python bench/local_vs_simulate.py --gloo              # and the plain gloo program (bench/gloo_baseline.py)
    python bench/local_vs_simulate.py --gloo --contention # and two simulations at once (the two-core floor)
    python bench/local_vs_simulate.py --gloo --gloo-batch # and gloo scheduled as `mdgan local` schedules its services
    python bench/local_vs_simulate.py --gloo --baseline ../main-before   # and `mdgan local` of another checkout
    python bench/local_vs_simulate.py --algorithm flgan --cases 10:1 --iterations 600 --no-fifty   # FL-GAN's

For each case the two modes run with the same flags and seed, alternately, `--repeats` times; each
run is sampled while it trains (its history.jsonl lines against the CPU time of its whole process
tree), so start-up is excluded: wall ms and CPU ms per iteration over the same window. The script
checks that both end with the same generator and prints medians and the median of the per-pair
ratios (pairs run back to back, so a busy machine slows both). With --gloo each pair is a triple:
bench/gloo_baseline.py, the same iteration over plain torch.distributed point-to-point sends (no
TLS, validation or metrics), sampled the same way. With --contention each round also runs two
simulations at once, each free to take a core of its own, and reports their mean: on a machine
whose cores share caches and memory bandwidth (this 2-core VM), that is what using the second core
costs any program, before it sends a single byte. Then `fifty_workers.measure`:
`mdgan local --workers 50 --kappa 5`, its start-up time and peak memory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fifty_workers import REPO, measure, tree  # noqa: E402

from mdgan.algorithms import SERVED  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def tree_cpu(pids: list[int]) -> float:
    """CPU seconds (user + system) of the live processes, their reaped children included."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            total += sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
        except (OSError, IndexError, ValueError):
            pass
    return total / TICK


def lines(path: str) -> int:
    try:
        with open(path, "rb") as fh:
            return fh.read().count(b"\n")
    except OSError:
        return 0


GLOO_BATCH = "gloo-batch"
TWO_AT_ONCE = "simulate*2"  # two identical simulations at the same time, one per core (--contention)


def run(mode: str, flags: list[str], out: str, iterations: int) -> dict:
    """One run, sampled every 50 ms: (iterations done, wall, tree CPU) between 10% and the end.
    TWO_AT_ONCE: two simulations started together; their mean per-iteration figures."""
    repo, env = REPO, None
    copies = 2 if mode == TWO_AT_ONCE else 1
    if mode == TWO_AT_ONCE:
        mode = "simulate"
    if mode == GLOO_BATCH:  # the gloo program, its processes scheduled as `mdgan local` schedules its services
        mode, env = "gloo", {**os.environ, "GLOO_CPU_SCHEDULING": "batch"}
    if mode.startswith("local@"):  # `mdgan local` of another checkout (--baseline)
        mode, repo = "local", mode.split("@", 1)[1]
        env = {**os.environ, "PYTHONPATH": repo}
    program = [os.path.join(REPO, "bench", "gloo_baseline.py")] if mode == "gloo" else ["-m", "mdgan_app.cli", mode]
    outs = [out] if copies == 1 else [f"{out}-{i}" for i in range(copies)]
    processes = [subprocess.Popen([sys.executable, *program, *flags, "--out", o, "--no-progress"], cwd=repo, env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for o in outs]
    first: list = [None] * copies
    last: list = [None] * copies
    while any(p.poll() is None for p in processes):
        for i, (process, o) in enumerate(zip(processes, outs)):
            done = lines(os.path.join(o, "history.jsonl"))
            if process.poll() is None and iterations // 10 <= done < iterations:
                last[i] = (done, time.perf_counter(), tree_cpu(tree(process.pid)))
                first[i] = first[i] or last[i]
        time.sleep(0.05)
    results = []
    for process, o, a, z in zip(processes, outs, first, last):
        _, err = process.communicate()
        if process.returncode != 0:
            raise SystemExit(f"mdgan {mode} failed:\n{err[-3000:]}")
        with open(os.path.join(o, "summary.json")) as fh:
            summary = json.load(fh)
        if a is None or z[0] == a[0]:  # finished between two samples of its middle 90%
            raise SystemExit(f"mdgan {mode}: {iterations} iterations were too few to time (sampled every 50 ms); "
                             f"give more --iterations")
        steps = z[0] - a[0]
        results.append({"ms": 1000 * (z[1] - a[1]) / steps, "cpu_ms": 1000 * (z[2] - a[2]) / steps,
                        "sha": summary["generator_sha256"], "swaps": summary["swaps"]})
    return {"ms": statistics.mean(r["ms"] for r in results), "cpu_ms": statistics.mean(r["cpu_ms"] for r in results),
            "sha": results[0]["sha"] if len({r["sha"] for r in results}) == 1 else "differ",
            "swaps": results[0]["swaps"]}


def run_flags(workers: int, kappa: int, iterations: int, data_root: str, batch_size: int = 10,
              swap_every: int = 100, seed: int = 0, algorithm: str = "mdgan") -> list[str]:
    """The flags of the benchmarks' runs, the same for `simulate` and `local`: MNIST MLP ACGAN, no
    evaluation (the other benches of this folder start their runs with these too). For FL-GAN,
    swap_every is its averaging period."""
    chosen = ["--algorithm", algorithm] if algorithm != "mdgan" else []  # the gloo program knows MD-GAN only
    return [*chosen, "--workers", str(workers), "--batch-size", str(batch_size), "--kappa", str(kappa), "--iterations",
            str(iterations), "--swap-every", str(swap_every), "--seed", str(seed), "--dataset", "mnist",
            "--data-root", data_root, "--eval-every", "-1"]


def compare(workers: int, kappa: int, args) -> bool:
    flags = run_flags(workers, kappa, args.iterations, args.data_root, args.batch_size, args.swap_every, args.seed,
                      args.algorithm)
    modes = ["simulate", "local", *(["gloo"] if args.gloo else []), *([GLOO_BATCH] if args.gloo_batch else []),
             *([TWO_AT_ONCE] if args.contention else []),
             *([f"local@{args.baseline}"] if args.baseline else [])]
    results: dict[str, list[dict]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for mode in modes[r % len(modes):] + modes[:r % len(modes)]:  # each mode goes first in turn
                results[mode].append(run(mode, flags, os.path.join(tmp, f"mode{modes.index(mode)}-{r}"),
                                         args.iterations))
    sim = results["simulate"]
    same = len({x["sha"] for rows in results.values() for x in rows}) == 1
    med = lambda rows, key: statistics.median(x[key] for x in rows)  # noqa: E731
    ratio = lambda rows, key: statistics.median(l[key] / s[key] for l, s in zip(rows, sim))  # noqa: E731
    print(f"{args.algorithm} N={workers} kappa={kappa} b={args.batch_size} I={args.iterations} "
          f"swaps={sim[0]['swaps']}, {args.repeats} rounds of {len(modes)} runs:")
    for mode in modes:
        print(f"  {mode:10} {med(results[mode], 'ms'):7.2f} ms/iteration  {med(results[mode], 'cpu_ms'):7.2f} ms "
              f"CPU/iteration")
    for mode in modes[1:]:
        rows = results[mode]
        runs = lambda key: ", ".join(format(l[key] / s[key], ".2f") for l, s in zip(rows, sim))  # noqa: E731
        print(f"  {mode} / simulate: {ratio(rows, 'ms'):.2f}x wall (runs: {runs('ms')}), "
              f"{ratio(rows, 'cpu_ms'):.2f}x CPU (runs: {runs('cpu_ms')})")
    if args.baseline:
        print(f"  local / local@baseline: {ratio_between(results['local'], results[modes[-1]], 'ms'):.2f}x wall, "
              f"{ratio_between(results['local'], results[modes[-1]], 'cpu_ms'):.2f}x CPU")
    if args.gloo:
        print(f"  local / gloo: {ratio_between(results['local'], results['gloo'], 'ms'):.2f}x wall, "
              f"{ratio_between(results['local'], results['gloo'], 'cpu_ms'):.2f}x CPU")
    if args.gloo_batch:
        print(f"  local / {GLOO_BATCH}: {ratio_between(results['local'], results[GLOO_BATCH], 'ms'):.2f}x wall, "
              f"{ratio_between(results['local'], results[GLOO_BATCH], 'cpu_ms'):.2f}x CPU")
    print(f"  same generator in every run: {same}")
    return same


def ratio_between(rows: list[dict], base: list[dict], key: str) -> float:
    return statistics.median(r[key] / b[key] for r, b in zip(rows, base))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithm", default="mdgan", choices=sorted(SERVED),
                        help="the algorithm of every case (those `mdgan local` runs)")
    parser.add_argument("--cases", default="4:1,10:3", help="N:kappa,... to compare")
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--swap-every", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3, help="simulate/local pairs per case")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-root", default=os.path.join(os.path.dirname(REPO), "shared", "data"))
    parser.add_argument("--no-fifty", action="store_true", help="skip the N=50 start-up run")
    parser.add_argument("--baseline", metavar="DIR", default=None,
                        help="also time `mdgan local` from the checkout in DIR (e.g. the commit before a change), "
                             "in the same rounds")
    parser.add_argument("--contention", action="store_true",
                        help=f"also time two simulations at once ({TWO_AT_ONCE}) in each round: what merely using "
                             "the second core costs each of them, the floor of any two-core program's CPU ratio")
    parser.add_argument("--gloo-batch", action="store_true",
                        help=f"also time the gloo program with its processes SCHED_BATCH and a 10 ms slice ({GLOO_BATCH}), "
                             "as `mdgan local` runs its services")
    parser.add_argument("--gloo", action="store_true",
                        help="also time the plain torch.distributed program (bench/gloo_baseline.py) in each round")
    args = parser.parse_args()
    if args.algorithm != "mdgan" and (args.gloo or args.gloo_batch):
        parser.error("--gloo and --gloo-batch time MD-GAN's plain torch.distributed program: --algorithm mdgan only")
    with open("/proc/loadavg") as fh:
        print(f"{os.cpu_count()} cores, load average {fh.read().split()[0]} at the start")
    ok = True
    for case in args.cases.split(","):
        workers, kappa = (int(x) for x in case.split(":"))
        ok &= compare(workers, kappa, args)
    if not args.no_fifty:
        flags = ["--workers", "50", "--kappa", "5", "--batch-size", str(args.batch_size), "--iterations", "40",
                 "--dataset", "mnist", "--data-root", args.data_root, "--eval-every", "-1"]
        with tempfile.TemporaryDirectory() as tmp:
            r = measure(flags, os.path.join(tmp, "run"))
        print(f"N=50 kappa=5: first iteration {r['first_iteration_s']:.1f} s after the command; peak memory "
              f"{r['peak_pss'] / 2**30:.2f} GiB PSS over {r['processes']} processes (MemAvailable fell by at most "
              f"{r['peak_available_drop'] / 2**30:.2f} GiB); workers_alive {r['summary']['workers_alive']} of 50")
        ok &= r["summary"]["workers_alive"] == 50
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
