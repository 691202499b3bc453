"""Train a kept run again for its first iterations and check that it is the same run, record by record.

    python experiments/replay.py docs/results/figure3-mnist-mlp/runs/standalone-N1-b100-k1-seed0 --iterations 3001
    ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE python experiments/replay.py RUN_DIR --iterations 3001

RUN_DIR is a run's record as `mdgan experiment --keep` keeps it: its settings (`run.json`) and
`history.jsonl`, which holds the training record written with each evaluation (MD-GAN's: iterations
1,001, 2,001, ...). This trains the same run (the settings, seed and crash schedule of the whole run) in this process
for --iterations, without scoring, and compares each of those records that it reached: the workers
that took part, the losses and the discriminators' accuracies, to the last digit. It prints one line
per record and exits 1 if any differs.

What it is for: a change to the code that should leave the kept runs' bits alone (say so with a
replay past the first crash, swap or checkpoint), and another machine, whose CPU kernels may sum in
another order (docs/RESULTS.md, "Reproducing a figure on another machine"): there, how far the records
agree says how far the figures reproduce. It runs in one process, as `mdgan experiment` does, and
takes the time of as many iterations of the run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from retrain_flags import add_retrain_flags, use_threads  # (also puts the repository on the import path)

COMPARED = ("active_workers", "answered", "lost", "gen_loss", "disc_loss", "real_accuracy", "fake_accuracy")


def replay(run_dir: str, iterations: int, data_root: str, out: str) -> list[dict]:
    """One row per kept record at or before `iterations`: its iteration, whether it is the same, and what
    differs ({field: (replayed, kept)})."""
    from mdgan_app.experiment import recorded_run, run_one

    with open(os.path.join(run_dir, "run.json"), encoding="utf-8") as fh:
        run = recorded_run(json.load(fh))
    with open(os.path.join(run_dir, "history.jsonl"), encoding="utf-8") as fh:
        kept = [json.loads(line) for line in fh if line.strip()]
    if not 0 < iterations <= run["iterations"]:
        raise ValueError(f"--iterations must be in 1..{run['iterations']} (the kept run's), not {iterations}")
    run_one(dict(run, data_root=data_root), out, progress=False, first=iterations)
    with open(os.path.join(out, "history.jsonl"), encoding="utf-8") as fh:
        replayed = {r["iteration"]: r for r in map(json.loads, fh)}
    rows = []
    for record in kept:
        mine = replayed.get(record["iteration"])
        if mine is None:
            continue
        differs = {k: (mine.get(k), record.get(k)) for k in COMPARED if mine.get(k) != record.get(k)}
        rows.append({"iteration": record["iteration"], "same": not differs, "differs": differs})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="a kept run: a folder with run.json and history.jsonl")
    parser.add_argument("--iterations", type=int, required=True, help="how many of its iterations to train again")
    add_retrain_flags(parser)
    args = parser.parse_args(argv)
    for name in ("run.json", "history.jsonl"):
        if not os.path.exists(os.path.join(args.run_dir, name)):
            parser.error(f"{args.run_dir} has no {name}: not a kept run")
    use_threads(args)
    with tempfile.TemporaryDirectory(prefix="replay-") as out:
        try:
            rows = replay(args.run_dir, args.iterations, args.data_root, out)
        except ValueError as exc:
            parser.error(str(exc))
    if not rows:
        print(f"no kept record at or before iteration {args.iterations}: train further")
        return 1
    for row in rows:
        print(f"{row['iteration']}: " + ("same" if row["same"] else "differs: " + ", ".join(
            f"{k} {mine} (kept {theirs})" for k, (mine, theirs) in row["differs"].items())))
    same = sum(row["same"] for row in rows)
    print(f"{same} of {len(rows)} kept records the same")
    return 0 if same == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
