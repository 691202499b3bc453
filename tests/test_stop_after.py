"""simulate(stop_after=K): a run's first K iterations as the whole run trains them, for every algorithm
of the registry (what experiments/replay.py and first_evaluation.py compare with a kept run)."""

from __future__ import annotations

import json

import pytest

from mdgan import algorithms
from mdgan.config import ConfigError, DataConfig, TrainingConfig
from mdgan.run import EvaluationOptions
from mdgan.simulation import Durability, simulate


def _run(out, iterations: int, algorithm: str, stop_after: int | None = None) -> tuple[dict, list[dict]]:
    # a round (FL-GAN's average, MD-GAN's swap) every 3 iterations: a stop after 4 falls inside the second
    config = TrainingConfig(workers=2, iterations=iterations, batch_size=8, swap_every=3).validate()
    summary = simulate(config, DataConfig("synthetic"), str(out), progress=False, algorithm=algorithm,
                       evaluation=EvaluationOptions(every=-1), stop_after=stop_after)
    with open(out / "history.jsonl") as fh:
        history = [{k: v for k, v in json.loads(line).items() if not k.endswith("seconds")} for line in fh]
    return summary, history


@pytest.mark.parametrize("algorithm", algorithms.NAMES)
def test_a_run_stopped_after_k_is_the_whole_runs_first_k(tmp_path, algorithm):
    whole, whole_history = _run(tmp_path / "whole", 8, algorithm)
    stopped, history = _run(tmp_path / "stopped", 8, algorithm, stop_after=4)
    assert [r["iteration"] for r in history] == [1, 2, 3, 4]
    assert history == whole_history[:4]  # losses, accuracies, workers: the records of the whole run
    assert (stopped["iterations"], stopped["stop_after"], stopped["config"]["iterations"]) == (4, 4, 8)
    assert "stop_after" not in whole and stopped["generator_sha256"] != whole["generator_sha256"]
    if algorithm == "flgan":
        # FL-GAN's G changes at its averages (3, 6, 8): after 4 the whole run holds the average of 3, where
        # a run of 4 iterations would close its second round early and end on an average the run never has
        third, _ = _run(tmp_path / "three", 8, algorithm, stop_after=3)
        short, _ = _run(tmp_path / "short", 4, algorithm)
        assert stopped["generator_sha256"] == third["generator_sha256"] != short["generator_sha256"]
        assert stopped["swaps"] == 1  # the round stopped inside is not a round of its record
    else:  # nothing of these depends on I: a run of 4 iterations is the whole run's first 4
        short, _ = _run(tmp_path / "short", 4, algorithm)
        assert stopped["generator_sha256"] == short["generator_sha256"]


def test_stop_after_outside_the_run_or_with_checkpoints_is_refused(tmp_path):
    config = TrainingConfig(workers=2, iterations=8, batch_size=8).validate()
    for stop_after in (0, 9, -1):
        with pytest.raises(ConfigError, match=r"stop_after must be in 1\.\.8"):
            simulate(config, DataConfig("synthetic"), str(tmp_path / "out"), progress=False,
                     evaluation=EvaluationOptions(every=-1), stop_after=stop_after)
    with pytest.raises(ConfigError, match="not with checkpoints"):
        simulate(config, DataConfig("synthetic"), str(tmp_path / "out"), progress=False,
                 evaluation=EvaluationOptions(every=-1), stop_after=4, durability=Durability(checkpoint_every=2))


def test_a_run_of_no_iteration_ends_on_the_initial_generator_for_every_algorithm(tmp_path):
    """--iterations 0: every algorithm writes its outputs for the generator it starts from, the same one (MD-GAN's
    pipeline check refused it, saying --pipeline-depth 0 must be below --iterations 0)."""
    hashes = set()
    for algorithm in algorithms.NAMES:
        summary, history = _run(tmp_path / algorithm, 0, algorithm)
        assert history == [] and summary["iterations"] == 0, algorithm
        hashes.add(summary["generator_sha256"])
    assert len(hashes) == 1
