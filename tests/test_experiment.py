import csv
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml

from mdgan.config import ConfigError
from mdgan_app.experiment import expand, load_config, run_experiment

from conftest import REPO
from procs import mdgan_in_process, session_processes


def _write(tmp_path, config: dict) -> str:
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_grid_and_runs_expand_with_readable_names(tmp_path):
    config = load_config(_write(tmp_path, {
        "out": str(tmp_path / "out"),
        "base": {"workers": 10, "batch_size": 10},
        "grid": {"algorithm": ["mdgan"], "kappa": [1, "log2"]},
        "runs": [{"algorithm": "standalone", "batch_size": 100}],
    }))
    runs = expand(config)
    assert [r["name"] for r in runs] == ["mdgan-N10-b10-k1", "mdgan-N10-b10-k3", "standalone-N1-b100-k1"]
    assert runs[1]["kappa"] == 3  # floor(log2 10)
    assert runs[2]["workers"] == 1  # a standalone GAN is one G and one D
    # runs that differ only in their optimizer's settings are two runs, not "the same" run twice
    adam = expand(load_config(_write(tmp_path, {
        "out": str(tmp_path / "out"), "runs": [{"kappa": 3}, {"kappa": 3, "gen_lr": 0.001, "beta1": 0.0}]})))
    assert [r["name"] for r in adam] == ["lrG0.0002-beta1_0.5", "lrG0.001-beta1_0.0"]


def test_swap_optimizer_state_reaches_the_training_config_and_names_the_run(tmp_path):
    from mdgan_app.experiment import training_config

    runs = expand(load_config(_write(tmp_path, {
        "runs": [{"kappa": 3}, {"kappa": 3, "swap_optimizer_state": True}]})))
    assert [r["name"] for r in runs] == ["swapstateFalse", "swapstateTrue"]
    assert [training_config(r).swap_optimizer_state for r in runs] == [False, True]
    with pytest.raises(ConfigError, match="true or false"):
        training_config(expand(load_config(_write(tmp_path, {"runs": [{"swap_optimizer_state": "yes"}]})))[0])


def test_bad_configs_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="unknown keys"):
        load_config(_write(tmp_path, {"grd": {}}))
    with pytest.raises(ConfigError, match="unknown run keys"):
        expand(load_config(_write(tmp_path, {"runs": [{"workerz": 3}]})))
    with pytest.raises(ConfigError, match="the same"):
        expand(load_config(_write(tmp_path, {"runs": [{"workers": 3}, {"workers": 3}]})))


@pytest.mark.parametrize("text, message", [
    ("base: {workers: 2\nruns: [{}]\n", r"not YAML \(line 2, column 5\): expected ',' or '}'"),
    ("runs: {x: {workers: 2}}\n", "runs must be a list of mappings"),
    ("base: [workers, 2]\nruns: [{}]\n", "base must be a mapping of settings"),
    ("grid: {workers: []}\n", "grid workers has no values"),
    ("out: 5\nruns: [{}]\n", "out must be a text"),
    ("base: {workers: ten}\nruns: [{}]\n", "workers must be a whole number, not 'ten'"),
    ("runs: [{iterations: 2.5}]\n", "iterations must be a whole number, not 2.5"),
    ("runs: [{swap_optimizer_state: 1}]\n", "swap_optimizer_state must be true or false, not 1"),
    ("runs: [{wire_dtype: float64}]\n", "wire_dtype must be one of float32, float16, bfloat16, int8"),
    ("runs: [{kappa: log3}]\n", "kappa must be a whole number or 'log2', not 'log3'"),
    ("runs: [{swap_every: sometimes}]\n", "swap_every must be a whole number or 'never' or null"),
    ("runs: [{gen_lr: fast}]\n", "gen_lr must be a number, not 'fast'"),
    ("runs: [{algorithm: pwgan, potential_rounds: 2.5}]\n", "potential_rounds must be a whole number"),
    ("runs: [{crash: 5}]\n", "crash must be a text or null, not 5"),
    ("runs: []\n", "the experiment has no runs: give `runs` a list"),
    ("base: {workers: 2}\n", "the experiment has no runs"),  # (nor a grid)
])
def test_a_config_of_the_wrong_shape_or_types_is_refused_in_one_line(tmp_path, text, message):
    """`mdgan experiment` (a real process) on a config that is not YAML, holds a key of the wrong shape or a value
    of the wrong type: exit 2, one line naming the key and what it takes, and nothing written."""
    path = tmp_path / "bad.yaml"
    path.write_text(text + f"name: bad\n" + ("" if text.startswith("out:") else f"out: {tmp_path / 'out'}\n"))
    done = subprocess.run([sys.executable, "-m", "mdgan_app.cli", "experiment", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and re.search(message, done.stderr), done.stderr
    assert sorted(os.listdir(tmp_path)) == ["bad.yaml"]


def test_numbers_yaml_reads_as_texts_and_the_keys_words_are_taken(tmp_path):
    """1e-4 (YAML reads a number without a dot as a text) is the number; log2, never and null where a key takes
    them."""
    runs = expand(load_config(_write(tmp_path, {"runs": [{"gen_lr": "1e-4", "kappa": "log2", "workers": 4,
                                                          "swap_every": "never", "dp_noise_multiplier": None}]})))
    assert runs[0]["gen_lr"] == 0.0001 and runs[0]["kappa"] == 2 and runs[0]["swap_every"] == "never"


def test_every_shipped_experiment_config_expands():
    folder = os.path.join(REPO, "experiments")
    names = sorted(f for f in os.listdir(folder) if f.endswith(".yaml"))
    assert {"figure3-mnist-mlp.yaml", "figure4-scaling-mlp.yaml", "figure5-crash-mlp.yaml"} <= set(names)
    for name in names:
        runs = expand(load_config(os.path.join(folder, name)))
        assert runs, name


@pytest.mark.slow
def test_a_small_experiment_runs_resumes_and_plots(tmp_path, mnist_root):
    out = tmp_path / "out"
    path = _write(tmp_path, {
        "name": "tiny", "out": str(out),
        "base": {"dataset": "mnist", "data_root": mnist_root, "iterations": 12, "eval_every": 6,
                 "eval_samples": 100, "eval_reference": 200, "workers": 3, "batch_size": 5, "swap_every": 4},
        "runs": [{"algorithm": "mdgan", "kappa": "log2"},
                 {"algorithm": "mdgan", "kappa": "log2", "crash": "every I/N"},
                 {"algorithm": "standalone"},
                 {"algorithm": "flgan"}],
    })
    result = run_experiment(path, progress=False)
    assert result["runs"] == result["ran"] == 4
    with open(out / "results.csv") as fh:
        lines = fh.read().splitlines()
    assert lines[0].startswith("run,label,algorithm")
    runs = {line.split(",")[0] for line in lines[1:]}
    assert runs == {"mdgan-N3", "mdgan-N3-crashIoverN", "standalone-N1", "flgan-N3"}  # what varies
    evaluated = sorted((row["run"], int(row["iteration"])) for row in csv.DictReader(lines))
    assert evaluated == sorted((run, i) for run in runs for i in (6, 12))  # every evaluation, once
    for name in ("mnist_score.png", "fid.png", "samples.png"):  # samples: every run's grid side by side
        assert (out / name).stat().st_size > 1000

    # the crash schedule: one worker fails every I/N = 4 iterations
    with open(out / "runs" / "mdgan-N3-crashIoverN" / "history.jsonl") as fh:
        history = [json.loads(line) for line in fh]
    assert [r["answered"] for r in history] == [3] * 4 + [2] * 4 + [1] * 4
    summary = json.loads((out / "runs" / "mdgan-N3-crashIoverN" / "summary.json").read_text())
    # the 3rd falls on the last iteration: none is left at the end, as the experiment's comment says
    assert summary["workers_alive"] == 0 and summary["scores"]["eval_iteration"] == 12

    again = run_experiment(path, progress=False)  # resumed: nothing left to run
    assert again["ran"] == 0 and again["rows"] == result["rows"]
    relabelled = yaml.safe_load(open(path))
    relabelled["runs"][0]["label"] = "MD-GAN, renamed"  # presentation only: still the finished run
    again = run_experiment(_write(tmp_path, relabelled), progress=False)
    assert again["ran"] == 0
    assert json.loads((out / "runs" / "mdgan-N3" / "run.json").read_text())["label"] == "MD-GAN, renamed"
    changed = yaml.safe_load(open(path))
    changed["base"]["iterations"] = 13
    with pytest.raises(ConfigError, match="other settings"):  # never mistaken for the finished runs
        run_experiment(_write(tmp_path, changed), progress=False)

    # samples from a finished run
    run_dir = out / "runs" / "mdgan-N3"
    for target in ("s.npy", "s.png"):
        subprocess.run([sys.executable, "-m", "mdgan_app.cli", "sample", str(run_dir), "--n", "30", "--out",
                        str(tmp_path / target)], cwd=REPO, check=True, capture_output=True)
    samples, labels = np.load(tmp_path / "s.npy"), np.load(tmp_path / "s.labels.npy")
    assert samples.shape == (30, 784) and samples.dtype == np.float32 and np.abs(samples).max() <= 1
    assert np.bincount(labels).tolist() == [3] * 10  # class-balanced
    assert (tmp_path / "s.png").stat().st_size > 500


@pytest.mark.slow
def test_runs_in_parallel_processes_give_the_runs_of_one_by_one(tmp_path):
    results = {}
    for jobs in (1, 2):
        out = tmp_path / f"jobs{jobs}"
        path = _write(tmp_path, {
            "name": "parallel", "out": str(out),
            "base": {"dataset": "synthetic", "iterations": 6, "workers": 3, "batch_size": 5, "swap_every": 3},
            "runs": [{"algorithm": "mdgan", "kappa": 1}, {"algorithm": "mdgan", "kappa": 2},
                     {"algorithm": "flgan"}],
        })
        result = run_experiment(path, progress=False, jobs=jobs)
        assert result["ran"] == 3
        results[jobs] = {d.name: json.loads((d / "summary.json").read_text())["generator_sha256"]
                         for d in (out / "runs").iterdir()}
    assert len(results[1]) == 3 and results[1] == results[2]
    assert len(set(results[1].values())) == 3  # three different generators, each equal to its twin
    with pytest.raises(ConfigError, match="jobs"):
        run_experiment(path, progress=False, jobs=0)


def test_pwgan_and_psgan_runs_take_their_options_and_the_runs_table_compares_them(tmp_path):
    out = tmp_path / "out"
    path = _write(tmp_path, {
        "name": "four", "out": str(out),
        "base": {"dataset": "synthetic", "iterations": 3, "workers": 3, "batch_size": 5, "gan": "gan"},
        "runs": [{"algorithm": "mdgan"},
                 {"algorithm": "pwgan", "potential_rounds": 2, "potential_lr": 0.5, "gradient_penalty": 1.0},
                 {"algorithm": "psgan", "ps_threshold": 2}],
    })
    result = run_experiment(path, progress=False)
    assert result["ran"] == 3
    summaries = {s["algorithm"]: s for s in (json.loads((d / "summary.json").read_text())
                                             for d in (out / "runs").iterdir())}
    assert summaries["pwgan"]["pwgan"] == {"potential_rounds": 2, "potential_lr": 0.5, "gradient_penalty": 1.0}
    assert summaries["psgan"]["psgan"] == {"threshold": 2}
    # T shows in the bytes: per worker per iteration 4 b d + 4 T b each way (docs/ALGORITHMS.md)
    assert summaries["pwgan"]["payload_bytes"]["server_to_worker"] == 3 * 3 * (4 * 5 * 784 + 4 * 2 * 5)

    with open(out / "runs.csv") as fh:
        rows = {row["algorithm"]: row for row in csv.DictReader(fh)}
    assert sorted(rows) == ["mdgan", "psgan", "pwgan"]
    for name, row in rows.items():
        for direction in ("server_to_worker", "worker_to_server", "worker_to_worker"):
            assert float(row[f"{direction}_bytes_per_iteration"]) == summaries[name]["payload_bytes"][direction] / 3
        assert float(row["seconds_per_iteration"]) > 0 and row["iterations"] == "3"
        assert row["machine_cpu_capability"] == torch.backends.cpu.get_cpu_capability() and row["machine_torch"]
    assert float(rows["mdgan"]["server_to_worker_bytes_per_iteration"]) == 3 * 2 * 5 * 784 * 4  # Table III


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGTERM to the command", "Ctrl-C to its process group", "SIGKILL to the command"])
def test_stopping_a_parallel_experiment_stops_its_runs_quietly(tmp_path, how):
    # A SIGTERM or a Ctrl-C used to wait for the runs under way to finish (hours), or to print a
    # traceback from every worker process.
    import signal
    import time

    path = _write(tmp_path, {
        "name": "long", "out": str(tmp_path / "out"),
        "base": {"dataset": "synthetic", "iterations": 1000000, "workers": 2, "batch_size": 5, "eval_every": -1},
        "runs": [{"algorithm": "mdgan", "kappa": 1}, {"algorithm": "mdgan", "kappa": 2}],
    })
    # (as from a terminal: SIGINT at its default, which a test run in the background has set to ignored)
    command = subprocess.Popen([sys.executable, "-m", "mdgan_app.cli", "experiment", path, "--jobs", "2", "--no-progress"],
                               cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while len(session_processes(command.pid)) < 3:  # the command and its two runs' processes
            assert command.poll() is None and time.monotonic() < deadline, command.communicate()
            time.sleep(0.2)
        time.sleep(3)  # the runs are training
        if how.startswith("SIGTERM"):
            command.send_signal(signal.SIGTERM)
        elif how.startswith("SIGKILL"):  # the OOM killer, say: the runs must not go on, orphaned
            command.send_signal(signal.SIGKILL)
        else:
            os.killpg(command.pid, signal.SIGINT)
        _, err = command.communicate(timeout=60)
        if how.startswith("SIGKILL"):
            assert command.returncode == -signal.SIGKILL
        else:
            expected = signal.SIGTERM if how.startswith("SIGTERM") else signal.SIGINT
            assert command.returncode == 128 + expected, err
            assert "Traceback" not in err and "leaked" not in err and "never awaited" not in err, err
            assert err.strip().splitlines()[-1] in ("mdgan experiment: SIGTERM: stopped; run it again to resume",
                                                     "mdgan experiment: interrupted")
        deadline = time.monotonic() + 30
        while session_processes(command.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert session_processes(command.pid) == []  # no run goes on behind it
    finally:
        for pid in session_processes(command.pid):
            os.kill(pid, signal.SIGKILL)


# `mdgan experiment` with a SIGTERM to itself right after its first run process is started, before that process has
# been sent what to run
SIGTERM_AT_FIRST_SPAWN = """
import multiprocessing.util, signal, sys
spawn = multiprocessing.util.spawnv_passfds
def spawn_then_sigterm(path, args, passfds, sent=[]):
    pid = spawn(path, args, passfds)
    if not sent and "--multiprocessing-fork" in args:  # (a run's process; not the resource tracker)
        sent.append(pid)
        signal.raise_signal(signal.SIGTERM)  # (its handler runs here and now)
    return pid
multiprocessing.util.spawnv_passfds = spawn_then_sigterm
from mdgan_app.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_sigterm_while_the_runs_processes_start_waits_until_they_have(tmp_path):
    """A SIGTERM that comes between a run process's start and the sending of what it is to run (here: exactly
    there) is handled once every process has started: the experiment stops as on any SIGTERM, and no process
    prints a traceback (one that was sent half its start printed EOFError)."""
    path = _write(tmp_path, {"out": str(tmp_path / "out"), "base": {
        "dataset": "synthetic", "iterations": 100000, "workers": 2, "batch_size": 5, "eval_every": -1},
        "runs": [{"kappa": 1}, {"kappa": 2}]})
    done = subprocess.run([sys.executable, "-c", SIGTERM_AT_FIRST_SPAWN, "experiment", path, "--jobs", "2",
                           "--no-progress"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 143 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1] == "mdgan experiment: SIGTERM: stopped; run it again to resume"


def test_an_experiments_runs_take_the_flags_names_too():
    """A run's settings may be written as the flags are (batch-size), as in a --config file."""
    from mdgan.config import ConfigError
    from mdgan_app.experiment import expand

    runs = expand({"base": {"batch-size": 7, "dataset": "synthetic"}, "grid": {"swap-every": [5, 10]},
                   "runs": [{"algorithm": "psgan", "ps-threshold": 1}]})
    assert [(r["batch_size"], r["swap_every"], r["ps_threshold"]) for r in runs] == [(7, 5, None), (7, 10, None),
                                                                                     (7, None, 1)]
    with pytest.raises(ConfigError, match="batch_sise"):
        expand({"runs": [{"batch-sise": 7}]})


def test_bands_average_the_seeds_of_a_setting(tmp_path):
    """plot: bands draws each label's mean over its seeds with a band, and bands.csv has the numbers."""
    import csv

    from mdgan_app.experiment import run_experiment

    path = _write(tmp_path, {
        "name": "seeds", "out": str(tmp_path / "out"), "plot": "bands",
        "base": {"dataset": "synthetic", "iterations": 4, "workers": 2, "batch_size": 5, "eval_every": -1},
        "runs": [{"algorithm": "mdgan", "seed": s, "label": "MD-GAN"} for s in (0, 1)]
                + [{"algorithm": "standalone", "seed": 0, "label": "standalone"}],
    })
    result = run_experiment(path, progress=False)
    assert result["ran"] == 3
    from mdgan_app.experiment import band_rows

    rows = [{"run": "a", "iteration": 10, "mnist_score": 2.0, "fid": 100.0},
            {"run": "b", "iteration": 10, "mnist_score": 4.0, "fid": 300.0}]
    runs = [{"name": "a", "label": "x"}, {"name": "b", "label": "x"}]
    band = band_rows(rows, runs)[0]
    assert band["seeds"] == 2 and band["mnist_score_mean"] == 3.0 and band["fid_mean"] == 200.0
    assert abs(band["fid_std"] - 141.42135623730951) < 1e-9 and band["fid_values"] == "100 300"
    assert band["mnist_score_large_mean"] is None
    from mdgan_app.experiment import plot

    rows += [{"run": "a", "iteration": 20, "mnist_score": 3.0, "fid": 50.0},
             {"run": "b", "iteration": 20, "mnist_score": 5.0, "fid": 70.0}]
    for png in plot(rows, runs, "bands", str(tmp_path), "seeds"):
        assert os.path.getsize(png) > 1000


@pytest.mark.slow
def test_the_kept_tables_count_each_run_as_it_finishes(tmp_path, mnist_root):
    """An experiment that dies midway (here its second run fails) leaves in its --keep folder the tables
    and plots of the runs finished before, not those of an older collection or none."""
    keep = tmp_path / "kept"
    config = {"name": "dies", "out": str(tmp_path / "out"), "plot": "bands",
              "base": {"dataset": "mnist", "data_root": mnist_root, "iterations": 4, "eval_every": 2,
                       "eval_samples": 100, "eval_reference": 200, "workers": 2, "batch_size": 5},
              "runs": [{"seed": 0}, {"seed": 1, "data_root": str(tmp_path / "no-data-here")}]}
    done = subprocess.run([sys.executable, "-m", "mdgan_app.cli", "experiment", _write(tmp_path, config),
                           "--no-progress", "--keep", str(keep)], cwd=REPO, capture_output=True, text=True)
    assert done.returncode != 0
    with open(keep / "results.csv") as fh:
        rows = list(csv.DictReader(fh))
    finished = sorted(os.listdir(keep / "runs"))
    assert len(finished) == 1 and (keep / "runs" / finished[0] / "summary.json").exists()
    assert sorted((r["run"], r["iteration"]) for r in rows) == [(finished[0], "2"), (finished[0], "4")]
    assert (keep / "fid.png").stat().st_size > 100


@pytest.mark.slow
def test_kept_runs_outlive_the_machine_that_ran_them(tmp_path, mnist_root):
    """--keep DIR: what a multi-day experiment keeps under git. A machine that starts with only DIR
    takes its finished runs as done, draws the same tables, and adds its own runs to DIR."""
    keep = tmp_path / "kept"
    config = {"name": "kept", "out": str(tmp_path / "machine1"),
              "base": {"dataset": "mnist", "data_root": mnist_root, "iterations": 6, "eval_every": 3,
                       "eval_samples": 100, "eval_reference": 200, "workers": 2, "batch_size": 5},
              "runs": [{"algorithm": "mdgan", "seed": s, "label": "MD-GAN"} for s in (0, 1)]
              + [{"algorithm": "standalone", "seed": 0, "label": "standalone"}],
              "plot": "bands"}

    def experiment(config: dict, kept=keep):
        """`mdgan experiment CONFIG --keep DIR`, in this process: its exit status and what it printed."""
        return mdgan_in_process("experiment", _write(tmp_path, config), "--no-progress", "--keep", kept, check=False)

    def experiment_ok(config: dict) -> dict:
        return json.loads(mdgan_in_process("experiment", _write(tmp_path, config), "--no-progress", "--keep", keep).stdout)

    first = experiment_ok(config)
    assert first["ran"] == 3 and sorted(first["kept"]) == ["mdgan-N2-seed0", "mdgan-N2-seed1", "standalone-N1-seed0"]
    full = (tmp_path / "machine1" / "runs" / "mdgan-N2-seed0" / "history.jsonl").read_text().splitlines()
    kept = (keep / "runs" / "mdgan-N2-seed0" / "history.jsonl").read_text().splitlines()
    # the lines that carry evaluations only (scoring runs beside training: a line carries those finished
    # since the line before, so the evaluations at 3 and 6 may come on one line or two)
    assert len(full) == 6 and 1 <= len(kept) <= 2
    assert [e["eval_iteration"] for line in kept for e in json.loads(line)["evaluations"]] == [3, 6]
    seconds = [json.loads(line)["seconds"] for line in full]
    at = {e["eval_iteration"]: e["train_seconds"] for line in kept for e in json.loads(line)["evaluations"]}
    assert at == {3: sum(seconds[:3]), 6: sum(seconds)}  # the training time up to the iteration scored
    for name in ("results.csv", "runs.csv", "bands.csv", "fid.png", "samples.png"):
        assert (keep / name).stat().st_size > 100

    # another machine, nothing but the kept folder: nothing to run, the same tables
    second = experiment_ok(dict(config, out=str(tmp_path / "machine2"), runs=config["runs"] + [
        {"algorithm": "standalone", "seed": 1, "label": "standalone"}]))
    assert second["ran"] == 1 and len(second["kept"]) == 4  # only the new run ran, and is kept now
    # a run restored and kept again keeps its training times (its history holds the evaluation lines only)
    again = (keep / "runs" / "mdgan-N2-seed0" / "history.jsonl").read_text().splitlines()
    assert {e["eval_iteration"]: e["train_seconds"] for line in again for e in json.loads(line)["evaluations"]} == at
    with open(tmp_path / "machine1" / "results.csv") as fh:
        before = [r for r in csv.DictReader(fh)]
    with open(keep / "results.csv") as fh:
        after = [r for r in csv.DictReader(fh)]
    assert [r for r in after if r["run"] != "standalone-N1-seed1"] == before
    assert {r["run"] for r in after} == {"mdgan-N2-seed0", "mdgan-N2-seed1", "standalone-N1-seed0", "standalone-N1-seed1"}

    # the tables of docs/RESULTS.md from the kept folder alone: a mean over the seeds, each seed after it
    tables = subprocess.run([sys.executable, "experiments/tables.py", str(keep), "--at", "3", "6", "--fid", "5000"],
                            cwd=REPO, capture_output=True, text=True, check=True).stdout
    fids = [float(r["fid"]) for r in after if r["label"] == "MD-GAN" and r["iteration"] == "6"]
    row = next(line for line in tables.splitlines() if line.startswith("| MD-GAN | 0, 1 |"))
    assert f"/ {sum(fids) / 2:.1f} +- " in row.split(" | ")[3] and f"({fids[0]:.1f}, {fids[1]:.1f})" in row
    assert "| standalone | 0, 1 | 3 (3, 3): " in tables  # FID <= 5000 at the first evaluation, for both seeds

    # another experiment holding the same run names it otherwise (names follow from what varies): copied
    # into its kept folder under that name, it is taken as done (Figure 5 reuses Figure 3's runs this way)
    import shutil

    other = tmp_path / "other-kept"
    shutil.copytree(keep / "runs" / "mdgan-N2-seed0", other / "runs" / "run")
    alone = dict(config, out=str(tmp_path / "machine4"), runs=config["runs"][:1])
    done = experiment(alone, kept=other)
    assert done.returncode == 0 and json.loads(done.stdout)["ran"] == 0, done.stderr

    # a kept run is never mistaken for a run of other settings
    changed = dict(config, out=str(tmp_path / "machine3"), base=dict(config["base"], batch_size=4))
    done = experiment(changed)
    assert done.returncode != 0 and "other settings" in done.stderr and "Traceback" not in done.stderr


def test_a_dry_run_times_each_unfinished_run_here_and_writes_nothing(tmp_path, capsys):
    from mdgan_app.cli import main
    from mdgan_app.experiment import dry_run

    out = tmp_path / "out"
    path = _write(tmp_path, {"name": "probe", "out": str(out), "base": {
        "dataset": "synthetic", "workers": 2, "iterations": 400, "eval_every": -1},
        "runs": [{"algorithm": "mdgan"}, {"algorithm": "flgan"}, {"algorithm": "standalone"}]})
    seen = []
    report = dry_run(path, probe=5, jobs=2, on_start=lambda r, names: seen.append(("start", r, names)),
                     on_row=lambda row: seen.append(("row", row)))
    assert not out.exists()  # nothing under the experiment's out
    # what a person watching sees, as each probe ends: the header first, then each run's row
    assert seen[0] == ("start", {k: report[k] for k in ("experiment", "machine", "probe_iterations", "jobs")},
                       ["mdgan-N2", "flgan-N2", "standalone-N1"])
    assert seen[1:] == [("row", row) for row in report["runs"]]
    timed = [r for r in report["runs"] if not r["finished"]]
    assert [r["name"] for r in timed] == ["mdgan-N2", "flgan-N2", "standalone-N1"] and report["jobs"] == 2
    for row in timed:
        assert row["seconds_per_iteration"] > 0 and row["expected_seconds"] == row["seconds_per_iteration"] * 400
    total = sum(r["expected_seconds"] for r in timed)
    assert report["one_at_a_time_seconds"] == pytest.approx(total)
    assert max(r["expected_seconds"] for r in timed) <= report["with_jobs_seconds"] <= total
    assert report["machine"].startswith(("CPU", "Intel", "AMD")) or "cores" in report["machine"]

    assert main(["experiment", path, "--dry-run", "--probe", "4", "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("probe: expected time on ") and "first 4 iterations" in lines[0]
    assert [line.split()[0] for line in lines[1:4]] == ["mdgan-N2", "flgan-N2", "standalone-N1"]
    assert "ms an iteration x 400 = " in lines[1] and lines[4].startswith("  all: ")
    assert not out.exists()


def test_an_experiments_device_is_every_runs_and_a_missing_one_is_one_line(tmp_path):
    from mdgan_app.experiment import _on_device

    runs = expand(load_config(_write(tmp_path, {"out": str(tmp_path / "o"), "runs": [{"kappa": 1}, {"kappa": 2}]})))
    assert {r["device"] for r in _on_device(runs, None)} == {"cpu"}
    assert {r["device"] for r in _on_device(runs, "cpu")} == {"cpu"}
    with pytest.raises(ConfigError, match="device must be cpu, cuda or cuda:N, got 'tpu'"):
        _on_device(runs, "tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device"):
            run_experiment(_write(tmp_path, {"out": str(tmp_path / "o"), "runs": [{"kappa": 1}]}), device="cuda")
        assert not (tmp_path / "o").exists()


def test_a_config_takes_its_base_from_another_and_sets_what_differs(tmp_path):
    """base_from: the other config's base (its own base_from applied, beside it), this one's keys over it."""
    (tmp_path / "grand.yaml").write_text("base: {dataset: synthetic, workers: 3, iterations: 10, seed: 0}\nruns: [{}]\n")
    (tmp_path / "parent.yaml").write_text("base_from: grand.yaml\nbase: {iterations: 20}\nruns: [{}]\n")
    (tmp_path / "child.yaml").write_text("base_from: parent.yaml\nbase: {seed: 2}\nruns: [{kappa: 1}]\n")
    (run,) = expand(load_config(str(tmp_path / "child.yaml")))
    assert (run["dataset"], run["workers"], run["iterations"], run["seed"], run["kappa"]) == ("synthetic", 3, 20, 2, 1)
    # neither runs nor grid: the other config's runs (and its plot) at this one's base; its own runs replace them
    (tmp_path / "shared.yaml").write_text("base: {dataset: synthetic, workers: 4, iterations: 10}\nplot: bands\n"
                                         "runs: [{seed: 0}, {seed: 1, kappa: 2}]\n")
    (tmp_path / "longer.yaml").write_text("base_from: shared.yaml\nbase: {iterations: 30}\n")
    longer = load_config(str(tmp_path / "longer.yaml"))
    assert longer["plot"] == "bands"
    assert [(r["seed"], r["kappa"], r["iterations"]) for r in expand(longer)] == [(0, 1, 30), (1, 2, 30)]
    (tmp_path / "own.yaml").write_text("base_from: shared.yaml\nruns: [{seed: 5}]\nplot: curves\n")
    own = load_config(str(tmp_path / "own.yaml"))
    assert own["plot"] == "curves" and [r["seed"] for r in expand(own)] == [5]
    (tmp_path / "loop.yaml").write_text("base_from: child2.yaml\n")
    (tmp_path / "child2.yaml").write_text("base_from: loop.yaml\n")
    with pytest.raises(ConfigError, match=r"comes back to itself \(loop.yaml -> child2.yaml -> loop.yaml\)"):
        load_config(str(tmp_path / "loop.yaml"))
    (tmp_path / "orphan.yaml").write_text("base_from: gone.yaml\n")
    with pytest.raises(ConfigError, match="orphan.yaml: base_from .*gone.yaml: No such file"):
        load_config(str(tmp_path / "orphan.yaml"))


@pytest.mark.parametrize("where", ["out", "--keep"])
def test_an_out_or_keep_that_is_a_file_is_refused_before_any_run(tmp_path, where):
    """Before, a --keep that was a file failed after every run had trained (Not a directory: 'FILE/runs')."""
    afile = tmp_path / "afile"
    afile.write_text("mine")
    out = afile if where == "out" else tmp_path / "out"
    path = _write(tmp_path, {"out": str(out), "base": {"dataset": "synthetic", "iterations": 2, "workers": 2,
                                                       "eval_every": -1}, "runs": [{}]})
    with pytest.raises(ConfigError, match=f"{where} {afile} is a file: give a folder"):
        run_experiment(path, progress=False, keep=str(afile) if where == "--keep" else None)
    assert sorted(os.listdir(tmp_path)) == ["afile", "exp.yaml"] and afile.read_text() == "mine"


@pytest.mark.parametrize("bad, message", [
    ({"eval_samples": 1}, "run .*eval_samples must be at least 2"),
    ({"eval_downstream": 100}, "eval_downstream: downstream accuracy is measured on MNIST, not synthetic"),
    ({"dp_noise_multiplier": 1.0, "dp_delta": 0.5}, "run .*delta"),
    ({"byzantine": 3, "attack": "sign-flip"}, "run .*byzantine"),
    ({"kappa": 5}, "run .*kappa"),
])
def test_a_bad_fifth_run_is_refused_before_the_experiment_writes_or_trains_anything(tmp_path, bad, message):
    """Before, ranges and consistency were checked inside each run: with --jobs 1 a bad fifth run failed after four
    had trained, and experiment.json and every run.json were written first."""
    out = tmp_path / "out"
    runs = [{"seed": s} for s in range(4)] + [{"seed": 4, **bad}]
    path = _write(tmp_path, {"out": str(out), "base": {"dataset": "synthetic", "iterations": 2, "workers": 2,
                                                       "eval_every": -1}, "runs": runs})
    with pytest.raises(ConfigError, match=message):
        run_experiment(path, progress=False)
    assert not out.exists()
