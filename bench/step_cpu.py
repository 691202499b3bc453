"""The CPU of one discriminator step in `mdgan simulate` and in `mdgan local`, and of a step that
follows a wait against one that follows another step directly.

    python bench/step_cpu.py                       # N=4, k=1, 1200 iterations each
    python bench/step_cpu.py --workers 10 --kappa 3 --iterations 600

Where `mdgan local` spends more CPU per iteration than `mdgan simulate`, this splits the difference
into the arithmetic and the rest: the same `DiscriminatorSide.step` (the same math on the same
data) is timed with the thread's CPU clock in both modes (bench/step_probe/sitecustomize.py wraps
it in every process of the run). A process of `mdgan local` waits between iterations (for the
server's batches), the simulation never does; on a virtual machine whose idle core is lent out, the
first step after a wait finds its caches cold (bench/idle_penalty.py). "The stepping thread" is the
CPU of the threads that ran the steps, per step, over the steps counted: in `mdgan local` the step
plus a worker's messaging; in the simulation the step plus its share of the generator's side.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fifty_workers import REPO  # noqa: E402
from local_vs_simulate import run_flags  # noqa: E402

PROBE = os.path.join(REPO, "bench", "step_probe")


def run(mode: str, args, tmp: str) -> dict:
    out = os.path.join(tmp, f"probe-{mode}")
    os.makedirs(out)
    env = {**os.environ, "MDGAN_STEP_PROBE": out, "PYTHONPATH": os.pathsep.join([PROBE, REPO])}
    subprocess.run([sys.executable, "-m", "mdgan_app.cli", mode,
                    *run_flags(args.workers, args.kappa, args.iterations, args.data_root), "--no-progress",
                    "--out", os.path.join(tmp, f"run-{mode}")], cwd=REPO, env=env, check=True,
                   stdout=subprocess.DEVNULL)
    total = {"after_wait": [0, 0], "back_to_back": [0, 0]}
    thread_ns = 0  # the stepping threads' CPU from their first counted step to their last
    for path in glob.glob(os.path.join(out, "*.json")):
        with open(path) as fh:
            counts = json.load(fh)
        for kind in total:
            total[kind][0] += counts[kind][0]
            total[kind][1] += counts[kind][1]
        thread_ns += counts["thread"][1] - counts["thread"][0]
    steps = sum(n for n, _ in total.values())
    if steps == 0:
        raise SystemExit(f"{mode}: no step counted past the warm-up; raise --iterations")
    return {"all": sum(ns for _, ns in total.values()) / steps / 1000, "thread": thread_ns / steps / 1000,
            **{kind: (ns / n / 1000 if n else None, n) for kind, (n, ns) in total.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--kappa", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=1200)
    parser.add_argument("--data-root", default=os.path.join(os.path.dirname(REPO), "shared", "data"))
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("simulate", "local"):
            results[mode] = run(mode, args, tmp)
    print(f"N={args.workers} kappa={args.kappa}, us of thread CPU per D step (after the first 200 steps of "
          f"each process):")
    for mode, r in results.items():
        parts = ", ".join(f"{kind.replace('_', ' ')} {us:.0f} ({n} steps)" for kind, (us, n) in
                          ((k, r[k]) for k in ("after_wait", "back_to_back")) if n)
        print(f"  {mode:9} {r['all']:6.0f}   {parts}; the stepping thread {r['thread']:.0f} per step")
    print(f"  local / simulate: {results['local']['all'] / results['simulate']['all']:.2f}x per step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
