"""experiments/first_evaluation.py: an experiment's first run trained to its first kept evaluation, here."""

import csv
import dataclasses
import os
import sys

import pytest
import yaml

from conftest import REPO

CHECK = os.path.join(REPO, "experiments", "first_evaluation.py")


@dataclasses.dataclass
class _Checked:
    returncode: int
    stdout: str
    stderr: str


def _check(*args: str) -> _Checked:
    """experiments/first_evaluation.py's main(args), in this process (its output captured)."""
    import contextlib
    import importlib.util
    import io

    if os.path.dirname(CHECK) not in sys.path:  # (the script imports its neighbour, retrain_flags)
        sys.path.insert(0, os.path.dirname(CHECK))
    spec = importlib.util.spec_from_file_location("first_evaluation", CHECK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = module.main([str(a) for a in args])
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
            if isinstance(exit.code, str):
                print(exit.code, file=sys.stderr)
    return _Checked(code, out.getvalue(), err.getvalue())


@pytest.mark.slow
def test_a_table_kept_as_results_csv_is_checked_by_its_first_evaluation(tmp_path, mnist_root):
    config = {"name": "two", "out": str(tmp_path / "out"),
              "base": {"dataset": "mnist", "data_root": mnist_root, "iterations": 8, "eval_every": 4,
                       "eval_samples": 100, "eval_reference": 200, "workers": 2, "batch_size": 5, "kappa": 1},
              "runs": [{"algorithm": "flgan", "seed": 0, "swap_every": 3},  # a round every 3 iterations
                       {"algorithm": "mdgan", "seed": 0}, {"algorithm": "mdgan", "seed": 1},
                       {"algorithm": "mdgan", "seed": 2, "crash": "every I/N"}]}
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(config))
    from mdgan_app.cli import main

    assert main(["experiment", str(path), "--no-progress"]) == 0
    results = tmp_path / "out" / "results.csv"
    with open(results, newline="") as fh:
        rows = list(csv.DictReader(fh))
    names = ["flgan-S3-seed0", "mdgan-seed0", "mdgan-seed1", "mdgan-crashIoverN-seed2"]
    assert sorted({(r["run"], r["iteration"]) for r in rows}) == sorted((n, i) for n in names for i in ("4", "8"))

    # the first run with rows: FL-GAN, whose evaluation at 4 falls inside its second round (4 to 6): trained
    # for its first 4 iterations as the whole run trains them, it holds the average of 3, as the kept run did
    same = _check(path, results, "--data-root", mnist_root)
    assert same.returncode == 0, same.stdout + same.stderr
    assert same.stdout.startswith("flgan-S3-seed0 at 4: ") and ": same (FID " in same.stdout
    plain = _check(path, results, "--run", "mdgan-seed0", "--data-root", mnist_root)
    assert plain.returncode == 0 and plain.stdout.startswith("mdgan-seed0 at 4: ") and ": same (FID " in plain.stdout

    # the table of a machine whose kernels sum in another order: seed 1's first FID one ulp off
    (seed1,) = [r for r in rows if r["run"] == "mdgan-seed1" and r["iteration"] == "4"]
    seed1["fid"] = repr(float(seed1["fid"]) * (1 + 2 ** -52))
    with open(results, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    changed = _check(path, results, "--run", "mdgan-seed1", "--data-root", mnist_root)
    assert changed.returncode == 1 and "mdgan-seed1 at 4: " in changed.stdout and ": differs (FID " in changed.stdout

    # its crash schedule is the whole run's (a crash after 4); a run of 4 iterations would crash after 2
    crashes = _check(path, results, "--run", "mdgan-crashIoverN-seed2", "--data-root", mnist_root)
    assert crashes.returncode == 0 and "mdgan-crashIoverN-seed2 at 4: " in crashes.stdout, crashes.stdout + crashes.stderr
    no_run = _check(path, results, "--run", "seed7", "--data-root", mnist_root)
    assert no_run.returncode == 2 and "the config has no run 'seed7'" in no_run.stderr
    other = tmp_path / "other.csv"
    other.write_text("run,iteration,mnist_score,fid\nelsewhere,4,1.0,900.0\n")
    foreign = _check(path, other, "--data-root", mnist_root)
    assert foreign.returncode == 2 and "no run of the config has rows" in foreign.stderr
    missing = _check(path, tmp_path / "absent.csv")
    assert missing.returncode == 2 and "no such file" in missing.stderr
    no_threads = _check(path, results, "--threads", "-1")
    assert no_threads.returncode == 2 and "--threads: must be >= 0, got -1" in no_threads.stderr
