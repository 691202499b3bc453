"""Where two runs that should be the same bit for bit part: `mdgan simulate` twice and `mdgan local` twice, each a
process of its own, with the same flags; prints each run's generator hash, the first iteration and field of
history.jsonl where a run leaves the first simulate, and every warning the runs printed about nondeterminism.

    python bench/gpu_divergence.py -- --algorithm pwgan --workers 3 --iterations 8 --gradient-penalty 5 \\
        --dataset synthetic --device cuda

simulate against simulate apart: something in one process is not repeatable (an op without a deterministic
kernel); local against local apart: something in the services is (an order of arrival, a timing); each repeatable
but apart from the other: the two transports compute something differently."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IGNORED = {"seconds", "generate_seconds", "wait_seconds", "update_seconds", "swap_seconds", "disc_seconds",
           "feedback_seconds", "time", "unix_time"}


def run(command: str, flags: list[str], out: str) -> tuple[dict, list[dict], list[str]]:
    done = subprocess.run([sys.executable, "-W", "always", "-m", "mdgan_app.cli", command, *flags, "--no-progress",
                           "--out", out], cwd=REPO, capture_output=True, text=True)
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
    parser.add_argument("flags", nargs="+", help="the runs' flags, after --")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mdgan-divergence-") as tmp:
        runs = {name: run(command, args.flags, os.path.join(tmp, name))
                for name, command in (("simulate", "simulate"), ("simulate again", "simulate"), ("local", "local"),
                                      ("local again", "local"))}
    reference = runs["simulate"][1]
    print(f"flags: {' '.join(args.flags)}")
    for name, (summary, history, warnings) in runs.items():
        print(f"  {name:<15} {summary['generator_sha256'][:16]}  {first_difference(reference, history)}")
        for line in warnings:
            print(f"      {line[:200]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
