"""`mdgan experiment --time-limit SECONDS` (mdgan_app/run_budget.py): the runs expected to end in time start,
shortest first; the others wait for another start; those under way when the time is up are stopped; the runs
that finished are kept, and the command says what is left (exit 3)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from mdgan_app import experiment, run_budget
from mdgan_app.experiment import iterations_left, run_experiment
from mdgan.config import ConfigError

from conftest import REPO

E = run_budget.Expected


def test_runs_start_shortest_first_while_each_ends_in_time_on_a_lane():
    runs = [E("long", 1.0, 50), E("short", 1.0, 10), E("middle", 1.0, 30), E("too-long", 1.0, 200)]
    one = run_budget.plan(runs, 60, jobs=1)
    assert [e.name for e in one.start] == ["short", "middle"] and [e.name for e in one.later] == ["long", "too-long"]
    two = run_budget.plan(runs, 60, jobs=2)  # short and middle on their own lanes; long after short (10 + 50)
    assert [e.name for e in two.start] == ["short", "middle", "long"] and [e.name for e in two.later] == ["too-long"]
    assert run_budget.plan(runs, 5, jobs=4).start == []
    assert run_budget.plan([E("done", 0.0, 0)], 0.5, jobs=1).start == [E("done", 0.0, 0)]
    with pytest.raises(ValueError):
        run_budget.plan(runs, 60, jobs=0)


def test_a_resumed_runs_iterations_left_are_those_after_its_last_complete_checkpoint(tmp_path):
    from mdgan.checkpoint import CheckpointStore

    run = {"iterations": 100}
    assert iterations_left(run, str(tmp_path / "never-started")) == 100
    store = CheckpointStore(str(tmp_path / "checkpoints"))
    store.save(40, "server", {"iteration": 40})
    store.mark_complete(40, {"run_id": "r"})
    store.save(60, "server", {"iteration": 60})  # (incomplete: not resumed from)
    assert iterations_left(run, str(tmp_path)) == 60


def _experiment(tmp_path, long_iterations: int) -> str:
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump({
        "name": "budget", "out": str(tmp_path / "out"),
        "base": {"dataset": "synthetic", "workers": 2, "batch_size": 10, "iterations": 30, "eval_every": -1},
        "runs": [{"algorithm": "mdgan"}, {"algorithm": "standalone"},
                 {"algorithm": "mdgan", "kappa": 2, "iterations": long_iterations}]}))
    return str(path)


def test_a_run_that_would_end_past_the_limit_waits_and_the_command_says_so(tmp_path, capsys):
    from mdgan_app.cli import main

    path = _experiment(tmp_path, 100000)  # (about half an hour here)
    keep = tmp_path / "kept"
    code = main(["experiment", path, "--no-progress", "--time-limit", "60", "--probe", "5", "--keep", str(keep)])
    out, err = capsys.readouterr()
    assert code == 3, err
    result = json.loads(out)
    assert result["later"] == ["mdgan-N2-k2-I100000"] and result["stopped"] == [] and result["ran"] == 2
    assert sorted(result["kept"]) == ["mdgan-N2-k1-I30", "standalone-N1-k1-I30"]
    lines = err.splitlines()
    assert [line.split(":")[1].split()[0] for line in lines if ": probed " in line] == ["probed"] * 3
    assert "mdgan experiment: later mdgan-N2-k2-I100000: about " in err and ", past the time limit" in err
    assert lines[-1] == ("mdgan experiment: --time-limit 60 s: 2 runs finished now, 1 left (mdgan-N2-k2-I100000); "
                         "run it again to go on")
    assert not (tmp_path / "out" / "runs" / "mdgan-N2-k2-I100000" / "history.jsonl").exists()  # never started
    # the next start (another machine, say) takes the kept runs as done and times only the one left
    code = main(["experiment", path, "--no-progress", "--time-limit", "60", "--probe", "5", "--keep", str(keep)])
    out, err = capsys.readouterr()
    assert code == 3 and json.loads(out)["ran"] == 0 and err.count(": probed ") == 1, err


@pytest.mark.slow
@pytest.mark.parametrize("jobs", [1, 2])
def test_runs_under_way_when_the_time_is_up_are_stopped_and_the_finished_ones_kept(tmp_path, monkeypatch, jobs):
    """Whatever the estimate said (here: that every run takes a millisecond at most), the runs still under way at the
    limit stop then: each trains in a process of its own (one at a time too), ended from outside."""
    monkeypatch.setattr(experiment, "probe_pace", lambda run, probe: 1e-9)
    path = _experiment(tmp_path, 1000000)  # (hours: a test that did not stop it would time out)
    keep = tmp_path / "kept"
    result = run_experiment(path, progress=False, jobs=jobs, keep=str(keep), time_limit=20 + 10 * (jobs - 1))
    assert result["stopped"] == ["mdgan-N2-k2-I1000000"] and result["later"] == [] and result["ran"] == 2, result
    assert sorted(os.listdir(keep / "runs")) == ["mdgan-N2-k1-I30", "standalone-N1-k1-I30"]
    assert not (tmp_path / "out" / "runs" / "mdgan-N2-k2-I1000000" / "summary.json").exists()
    with open(keep / "runs.csv") as fh:
        assert len(fh.read().splitlines()) == 3  # the two finished runs' rows


@pytest.mark.slow
def test_a_time_limit_is_refused_where_it_means_nothing(tmp_path, capsys):
    from mdgan_app.cli import main

    path = _experiment(tmp_path, 40)
    for flags, said in ((["--time-limit", "30", "--dry-run"], "not with --dry-run"),
                        (["--time-limit", "30", "--plot-only"], "not with --plot-only"),
                        (["--time-limit", "30", "--probe", "3"], "--probe must be more than 3")):
        assert main(["experiment", path, *flags]) == 2
        assert said in capsys.readouterr().err
    with pytest.raises(ConfigError, match="more than 0"):
        run_experiment(path, progress=False, time_limit=0)
    for bad in ("0", "-5", "nan", "soon"):
        done = subprocess.run([sys.executable, "-m", "mdgan_app.cli", "experiment", path, "--time-limit", bad],
                              cwd=REPO, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and "--time-limit" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()  # nothing written by a refusal


def _deaf_to_sigterm() -> None:
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _busy(flag: str) -> None:
    import time

    open(flag, "w").close()
    time.sleep(600)


@pytest.mark.timeout(120)  # (without the kill, Pool.join waits forever)
def test_a_run_process_that_outlives_its_sigterm_is_killed_instead_of_holding_the_experiment(tmp_path):
    """A pool process that does not die of its SIGTERM (here: it ignores it, busy; in the full suite one took the
    SIGTERM as an ordinary error and went back to wait for work) is killed after a grace, so the experiment ends;
    other children of the experiment's process are left alone."""
    import multiprocessing
    import signal
    import time

    bystander = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(120,))  # not the pool's
    bystander.start()
    try:
        others = set(multiprocessing.active_children())
        pool = multiprocessing.get_context("spawn").Pool(processes=1, initializer=_deaf_to_sigterm)
        processes = set(multiprocessing.active_children()) - others
        flag = tmp_path / "busy"
        pool.apply_async(_busy, (str(flag),))
        deadline = time.monotonic() + 60
        while not flag.exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        experiment._end_processes(pool, others, grace=1.0)
        assert len(processes) == 1 and [p.exitcode for p in processes] == [-signal.SIGKILL]
        assert bystander.is_alive()  # only the pool's processes
    finally:
        bystander.kill()
        bystander.join()
