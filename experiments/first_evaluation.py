"""Train one run of an experiment to its first kept evaluation and compare its scores with the kept ones.

    python experiments/first_evaluation.py experiments/byzantine-mlp-cpu.yaml docs/results/byzantine-cpu/results.csv
    python experiments/first_evaluation.py experiments/compression-mlp-cpu.yaml docs/results/compression-cpu/results.csv

A table of docs/RESULTS.md whose folder in docs/results/ holds only `results.csv` (no kept runs for
experiments/replay.py) can still be checked on this machine: its command trains the same computation,
and the first evaluation (a few hundred iterations) already shows whether this machine's CPU kernels
give the digits of the machine that wrote the table (docs/RESULTS.md, "Reproducing a figure on another
machine"). This trains the config's first run that the CSV has rows for (or --run NAME) for as many
iterations as its first evaluation there, in this process (through the same `run_one(first=K)` as
replay.py: the run's first K iterations as the whole run trains them, its crash schedule and FL-GAN's
rounds included), and prints both MNIST score / FID pairs.
"Same" is the FID to the last digit and the MNIST score to 1e-12: scores kept before the scorer stopped
drawing on the global random generator (issue 34) can differ from today's in their last bit.
It exits 0 when the same, 1 when not, 2 on bad input.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import tempfile

from retrain_flags import add_retrain_flags, use_threads  # (also puts the repository on the import path)

SCORE_TOLERANCE = 1e-12


def kept_first_evaluation(rows: list[dict], runs: list[dict], name: str | None) -> tuple[dict, dict]:
    """(the run's settings, its kept row at its first evaluation); ValueError when there is none."""
    kept = {r["run"] for r in rows}
    if name is not None:
        chosen = [run for run in runs if run["name"] == name]
        if not chosen:
            raise ValueError(f"the config has no run {name!r}: its runs are {', '.join(r['name'] for r in runs)}")
        if name not in kept:
            raise ValueError(f"the results have no rows for run {name!r}")
    else:
        chosen = [run for run in runs if run["name"] in kept]
        if not chosen:
            raise ValueError("no run of the config has rows in the results: another experiment's results.csv?")
    run = chosen[0]
    first = min((r for r in rows if r["run"] == run["name"]), key=lambda r: int(r["iteration"]))
    return run, first


def train_to(run: dict, iterations: int, data_root: str, out: str) -> dict:
    """Scores of the run trained for `iterations` here: its last evaluation record."""
    from mdgan_app.experiment import run_one

    run_one(dict(run, data_root=data_root), out, progress=False, first=iterations, score_first=True)
    with open(os.path.join(out, "history.jsonl"), encoding="utf-8") as fh:
        scored = [record for record in map(json.loads, fh) if "fid" in record]
    return scored[-1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="the experiment's config (experiments/*.yaml)")
    parser.add_argument("results", help="the results.csv its table was written from (docs/results/*/results.csv)")
    parser.add_argument("--run", default=None,
                        help="the run to check, by its folder name (default: the first with rows)")
    add_retrain_flags(parser)
    args = parser.parse_args(argv)
    for path in (args.config, args.results):
        if not os.path.isfile(path):
            parser.error(f"{path}: no such file")
    from mdgan_app.experiment import expand, load_config  # its ConfigError is a ValueError

    try:
        runs = expand(load_config(args.config))
        with open(args.results, encoding="utf-8", newline="") as fh:
            rows = list(csv.DictReader(fh))
        if not rows or not {"run", "iteration", "mnist_score", "fid"} <= set(rows[0]):
            raise ValueError(f"{args.results}: not an experiment's results.csv (run, iteration, mnist_score, fid)")
        run, kept = kept_first_evaluation(rows, runs, args.run)
    except ValueError as exc:
        parser.error(str(exc))
    use_threads(args)
    iterations = int(kept["iteration"])
    with tempfile.TemporaryDirectory(prefix="first-evaluation-") as out:
        mine = train_to(run, iterations, args.data_root, out)
    kept_score, kept_fid = float(kept["mnist_score"]), float(kept["fid"])
    same = mine["fid"] == kept_fid and abs(mine["mnist_score"] - kept_score) <= SCORE_TOLERANCE
    print(f"{run['name']} at {iterations:,}: here {mine['mnist_score']:.2f} / {mine['fid']:.1f}, "
          f"kept {kept_score:.2f} / {kept_fid:.1f}: {'same' if same else 'differs'} "
          f"(FID {mine['fid']!r} against {kept_fid!r})")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
