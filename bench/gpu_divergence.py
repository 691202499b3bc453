"""Where two runs that should be the same bit for bit part: `mdgan simulate` twice and `mdgan local` twice, each a
process of its own, with the same flags; prints each run's generator hash, the first iteration and field of
history.jsonl where a run leaves the first simulate, and every warning the runs printed about nondeterminism.

    python bench/gpu_divergence.py -- --algorithm pwgan --workers 3 --iterations 8 --gradient-penalty 5 \\
        --dataset synthetic --device cuda

simulate against simulate apart: something in one process is not repeatable (an op without a deterministic
kernel); local against local apart: something in the services is (an order of arrival, a timing); each repeatable
but apart from the other: the two transports compute something differently.

    python bench/gpu_divergence.py --trace -- --algorithm pwgan ...

also traces every run tensor by tensor (mdgan/tensor_trace.py: G's and each D's forward outputs, gradients and
weights after each optimizer step) and prints, for each network, the first record where a run leaves the first
simulate: the module, gradient or step where they part."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from mdgan import tensor_trace  # noqa: E402
IGNORED = {"seconds", "generate_seconds", "wait_seconds", "update_seconds", "swap_seconds", "disc_seconds",
           "feedback_seconds", "time", "unix_time"}


def run(command: str, flags: list[str], out: str, trace: str | None = None) -> tuple[dict, list[dict], list[str]]:
    env = dict(os.environ, **({tensor_trace.ENVIRONMENT: trace} if trace else {}))
    done = subprocess.run([sys.executable, "-W", "always", "-m", "mdgan_app.cli", command, *flags, "--no-progress",
                           "--out", out], cwd=REPO, capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"{command} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    warnings = sorted({line.strip() for line in (done.stderr + done.stdout).splitlines()
                       if "determinis" in line.lower()})
    with open(os.path.join(out, "summary.json"), encoding="utf-8") as fh:
        summary = json.load(fh)
    with open(os.path.join(out, "history.jsonl"), encoding="utf-8") as fh:
        history = [json.loads(line) for line in fh if line.strip()]
    return summary, history, warnings


def first_difference(a: list[dict], b: list[dict]) -> str:
    for line_a, line_b in zip(a, b):
        for key in sorted(set(line_a) | set(line_b)):
            if key not in IGNORED and line_a.get(key) != line_b.get(key):
                return f"iteration {line_a.get('iteration')}: {key} {line_a.get(key)!r} != {line_b.get(key)!r}"
    return "the histories agree" if len(a) == len(b) else f"{len(a)} against {len(b)} lines"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", action="store_true", help="also trace each run tensor by tensor and say where "
                                                                 "each network's records part")
    parser.add_argument("flags", nargs="+", help="the runs' flags, after --")
    args = parser.parse_args()
    names = (("simulate", "simulate"), ("simulate again", "simulate"), ("local", "local"), ("local again", "local"))
    print(f"flags: {' '.join(args.flags)}", flush=True)
    with tempfile.TemporaryDirectory(prefix="mdgan-divergence-") as tmp:
        traces = {name: os.path.join(tmp, f"trace-{i}") if args.trace else None for i, (name, _) in enumerate(names)}
        runs = {}
        for name, command in names:  # each run's line as it ends
            summary, history, warnings = runs[name] = run(command, args.flags, os.path.join(tmp, name), traces[name])
            print(f"  {name:<15} {summary['generator_sha256'][:16]}  {first_difference(runs['simulate'][1], history)}",
                  flush=True)
            for line in warnings:
                print(f"      {line[:200]}", flush=True)
        records = {name: tensor_trace.read(trace) for name, trace in traces.items() if trace}
    if records:
        print("where each network's records part from the first simulate's:")
    for name in records:
        for network, where in tensor_trace.first_differences(records["simulate"], records[name]).items():
            print(f"  {name:<15} {network:<4} {where or 'every record agrees'} "
                  f"({len(records[name].get(network, []))} records)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
