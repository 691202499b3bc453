"""experiments/replay.py: a kept run trained again for its first iterations, record by record."""

import json
import os
import subprocess
import sys

import pytest
import yaml

from conftest import REPO
from procs import mdgan_in_process

REPLAY = os.path.join(REPO, "experiments", "replay.py")


def _replay(run_dir, iterations: int, mnist_root: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, REPLAY, str(run_dir), "--iterations", str(iterations),
                           "--data-root", mnist_root], cwd=REPO, capture_output=True, text=True)


@pytest.mark.slow
def test_a_kept_crash_run_replays_to_the_last_digit_and_a_changed_record_is_found(tmp_path, mnist_root):
    keep = tmp_path / "kept"
    config = {"name": "crashes", "out": str(tmp_path / "out"),
              "base": {"dataset": "mnist", "data_root": mnist_root, "iterations": 12, "eval_every": 3,
                       "eval_samples": 100, "eval_reference": 200, "workers": 3, "batch_size": 5, "swap_every": 4},
              "runs": [{"algorithm": "mdgan", "kappa": "log2", "crash": "every I/N"}]}
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(config))
    mdgan_in_process("experiment", str(path), "--no-progress", "--keep", str(keep))
    (name,) = os.listdir(keep / "runs")
    run_dir = keep / "runs" / name

    # The kept history holds the lines that carry an evaluation; which line a background evaluation
    # lands on depends on the machine's load, so the records within the replay are counted, not assumed.
    with open(run_dir / "history.jsonl") as fh:
        records = [json.loads(line) for line in fh]
    within = [r for r in records if r["iteration"] <= 8]
    assert within, records
    # 8 of its 12 iterations: past the crash after 4 (I/N of the whole run; replayed with I/N of 8,
    # a crash after 2 would show in the kept records after iteration 2)
    assert all(r["active_workers"] == (3 if r["iteration"] <= 4 else 2) for r in within), within
    replayed = _replay(run_dir, 8, mnist_root)
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert replayed.stdout.splitlines()[-1] == f"{len(within)} of {len(within)} kept records the same"

    within[-1]["gen_loss"] += 1e-12  # one bit of one loss (the record is the same object as in `records`)
    with open(run_dir / "history.jsonl", "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records)
    changed = _replay(run_dir, 8, mnist_root)
    assert changed.returncode == 1
    assert f"{within[-1]['iteration']}: differs: gen_loss" in changed.stdout
    assert f"{len(within) - 1} of {len(within)} kept records the same" in changed.stdout

    too_far = _replay(run_dir, 13, mnist_root)
    assert too_far.returncode == 2 and "--iterations must be in 1..12" in too_far.stderr
    not_a_run = _replay(tmp_path, 4, mnist_root)
    assert not_a_run.returncode == 2 and "not a kept run" in not_a_run.stderr
