"""The standalone GAN and FL-GAN checkpoint and resume in one process (mdgan/algorithms/loop_checkpoints.py): a run
resumed from a checkpoint ends with the generator, history and rounds of the run that was not stopped; with DP a
site's ledger counts the steps it takes again; on the services FL-GAN still refuses them."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import yaml
from opacus.accountants import RDPAccountant

from mdgan.checkpoint import CheckpointStore
from mdgan.config import DataConfig, PrivacySpec, TrainingConfig
from mdgan.run_spec import Durability, EvaluationOptions
from mdgan.simulation import simulate

QUIET = EvaluationOptions(every=-1)


def _lines(path) -> list[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh]


@pytest.mark.parametrize("algorithm, complete", [("standalone", [8, 16, 24]), ("flgan", [14, 21, 28])])
def test_a_run_resumed_from_a_checkpoint_ends_as_the_run_not_stopped(tmp_path, algorithm, complete):
    """FL-GAN's rounds are 7 iterations (swap_every): a checkpoint due at 8 is taken at the round's end, 14."""
    config = TrainingConfig(workers=3, iterations=30, batch_size=8, swap_every=7, seed=5).validate()
    data, out = DataConfig("synthetic"), str(tmp_path / "run")
    plain = simulate(config, data, str(tmp_path / "plain"), algorithm=algorithm, progress=False, evaluation=QUIET)
    full = simulate(config, data, out, algorithm=algorithm, progress=False, evaluation=QUIET,
                    durability=Durability(checkpoint_every=8, keep_checkpoints=10))
    assert full["generator_sha256"] == plain["generator_sha256"]  # checkpoints change nothing
    store = CheckpointStore(os.path.join(out, "checkpoints"))
    assert store.complete() == complete
    history, rounds = _lines(os.path.join(out, "history.jsonl")), _lines(os.path.join(out, "swaps.jsonl"))
    for later in complete[1:]:  # as if the process had died before the second checkpoint
        shutil.rmtree(store.folder(later))
    os.remove(os.path.join(out, "summary.json"))
    resumed = simulate(config, data, out, algorithm=algorithm, progress=False, evaluation=QUIET,
                       durability=Durability(checkpoint_every=8, resume="yes"))
    assert resumed["resumed_from"] == complete[0]
    assert resumed["generator_sha256"] == full["generator_sha256"]
    assert resumed["payload_bytes"] == full["payload_bytes"] and resumed["swaps"] == full["swaps"]
    drop = ("seconds", "wall_seconds", "train_seconds")
    again = _lines(os.path.join(out, "history.jsonl"))
    assert [r["iteration"] for r in again] == list(range(1, 31))  # no gap, no duplicate
    assert [{k: v for k, v in r.items() if k not in drop} for r in again] == \
        [{k: v for k, v in r.items() if k not in drop} for r in history]
    assert _lines(os.path.join(out, "swaps.jsonl")) == rounds


def test_a_private_run_resumed_counts_again_the_steps_it_takes_again(tmp_path):
    """With DP the site's ledger is not wound back with the checkpoint: the 22 steps after iteration 8 taken twice
    are spent twice (the noise of the second time is fresh, so the run is not the same)."""
    config = TrainingConfig(workers=1, iterations=30, batch_size=8, seed=2,
                            privacy=PrivacySpec(noise_multiplier=1.2)).validate()
    data, out = DataConfig("synthetic"), str(tmp_path / "run")
    full = simulate(config, data, out, algorithm="standalone", progress=False, evaluation=QUIET,
                    durability=Durability(checkpoint_every=8, keep_checkpoints=10))
    store = CheckpointStore(os.path.join(out, "checkpoints"))
    for later in store.complete()[1:]:
        shutil.rmtree(store.folder(later))
    os.remove(os.path.join(out, "summary.json"))
    resumed = simulate(config, data, out, algorithm="standalone", progress=False, evaluation=QUIET,
                       durability=Durability(checkpoint_every=8, resume="yes"))
    site = resumed["privacy"]["sites"]["worker-0"]
    accountant = RDPAccountant()
    for _ in range(30 + 22):
        accountant.step(noise_multiplier=1.2, sample_rate=8 / resumed["worker_sizes"]["worker-0"])
    assert site["epsilon"] == pytest.approx(accountant.get_epsilon(site["delta"]), rel=1e-9)
    assert site["epsilon"] > full["privacy"]["sites"]["worker-0"]["epsilon"]
    assert resumed["generator_sha256"] != full["generator_sha256"]


@pytest.mark.parametrize("command, algorithm, flags, message", [
    ("simulate", "pwgan", ["--checkpoint-every", "5"],
     "--checkpoint-every and --resume work in one process with --algorithm mdgan, flgan, standalone only, not "
     "--algorithm pwgan"),
    ("local", "flgan", ["--checkpoint-every", "5"],
     "--checkpoint-every and --resume work on the services with --algorithm mdgan only, not --algorithm flgan"),
    ("simulate", "flgan", ["--churn", "leave:4:1"], "--churn works with --algorithm mdgan only, not --algorithm flgan"),
])
def test_what_an_algorithm_cannot_resume_is_refused_in_one_line(tmp_path, capsys, command, algorithm, flags, message):
    from mdgan_app.cli import main

    code = main([command, "--algorithm", algorithm, "--workers", "2", "--dataset", "synthetic", "--iterations", "8",
                 "--out", str(tmp_path / "run"), "--no-progress", *flags])
    assert code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_an_experiments_flgan_run_stopped_at_its_time_limit_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    from mdgan_app import experiment

    base = {"dataset": "synthetic", "workers": 2, "batch_size": 10, "iterations": 600, "eval_every": -1,
            "swap_every": 10}
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump({"name": "fl", "out": str(tmp_path / "out"), "base": {**base, "checkpoint_every": 10},
                                    "runs": [{"algorithm": "flgan"}]}))
    monkeypatch.setattr(experiment, "probe_pace", lambda run, probe: 1e-9)  # (it is started, whatever it takes)
    stopped = experiment.run_experiment(str(path), progress=False, time_limit=12)
    assert stopped["stopped"] == ["run"], stopped
    run_dir = tmp_path / "out" / "runs" / "run"
    done = CheckpointStore(str(run_dir / "checkpoints")).latest_complete()
    assert done and 0 < done < 600 and experiment.iterations_left(
        experiment.expand(experiment.load_config(str(path)))[0], str(run_dir)) == 600 - done
    finished = experiment.run_experiment(str(path), progress=False)
    assert finished["ran"] == 1
    with open(run_dir / "summary.json") as fh:
        summary = json.load(fh)
    plain = simulate(TrainingConfig(workers=2, batch_size=10, iterations=600, swap_every=10).validate(),
                     DataConfig("synthetic"), str(tmp_path / "plain"), algorithm="flgan", progress=False,
                     evaluation=QUIET)
    assert summary["resumed_from"] == done and summary["generator_sha256"] == plain["generator_sha256"]


@pytest.mark.parametrize("saved, resumed_as", [("standalone", "mdgan"), ("mdgan", "flgan"), ("flgan", "standalone")])
def test_a_checkpoint_is_resumed_only_by_the_algorithm_that_saved_it(tmp_path, saved, resumed_as):
    config = TrainingConfig(workers=2, iterations=12, batch_size=8, swap_every=4, seed=1).validate()
    data, out = DataConfig("synthetic"), str(tmp_path / "run")
    simulate(config, data, out, algorithm=saved, progress=False, evaluation=QUIET,
             durability=Durability(checkpoint_every=4, keep_checkpoints=5))
    os.remove(os.path.join(out, "summary.json"))
    with open(os.path.join(out, "history.jsonl")) as fh:
        history = fh.read()
    from mdgan.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match=f"is a {saved} run's, not {resumed_as}'s: resume it as that"):
        simulate(config, data, out, algorithm=resumed_as, progress=False, evaluation=QUIET,
                 durability=Durability(checkpoint_every=4, resume="yes"))
    with open(os.path.join(out, "history.jsonl")) as fh:
        assert fh.read() == history  # refused before anything was written
