"""The swap check (mdgan/algorithms/mdgan/swapcheck.py) in whole runs: every poisoned discriminator a
member pushes is refused, no honest one is, and refusals are recorded where an operator looks."""

from __future__ import annotations

import json

import pytest

from mdgan.attacks import SWAP_ATTACKS
from mdgan.config import ConfigError, DataConfig, TrainingConfig
from mdgan.run import EvaluationOptions
from mdgan.simulation import Emulation, simulate


def _run(tmp_path, name: str, byzantine: int = 0, attack: str | None = None,
         options=None) -> tuple[dict, list[dict]]:
    config = TrainingConfig(workers=4, iterations=40, batch_size=8, swap_every=5, seed=3).validate()
    summary = simulate(config, DataConfig("synthetic"), str(tmp_path / name), progress=False,
                       evaluation=EvaluationOptions(every=-1), options=options,
                       emulation=Emulation(byzantine=byzantine, attack=attack))
    with open(tmp_path / name / "swaps.jsonl") as fh:
        return summary, [json.loads(line) for line in fh]


@pytest.mark.parametrize("lag", (0, 3))
@pytest.mark.parametrize("attack", SWAP_ATTACKS)
def test_every_poisoned_push_is_refused_and_no_honest_one(tmp_path, attack, lag):
    """(lag 3: background swaps, judged when installed)"""
    from mdgan.algorithms.mdgan.options import MDGANOptions

    summary, swaps = _run(tmp_path, attack, byzantine=1, attack=attack, options=MDGANOptions(swap_lag=lag))
    attacker = "worker-3"
    poisoned = honest = 0
    for record in swaps:
        for sender, receiver in record["plan"].items():
            outcome = record["workers"][receiver]
            if sender == attacker:
                poisoned += 1
                assert not outcome["received"] and outcome["refused"], record
                assert outcome["error"].startswith(f"refused the discriminator from {attacker}: "), record
            else:
                honest += 1
                assert outcome["received"] and "refused" not in outcome, record
    assert poisoned == len(swaps) == 8 and honest == 3 * len(swaps)
    assert summary["swaps_refused"] == poisoned


def test_an_honest_run_refuses_nothing_and_the_check_changes_nothing(tmp_path):
    checked, swaps = _run(tmp_path, "checked")
    assert checked["swaps_refused"] == 0 and all(w["received"] for s in swaps for w in s["workers"].values())
    from mdgan.algorithms.mdgan.options import MDGANOptions

    unchecked, _ = _run(tmp_path, "unchecked", options=MDGANOptions(swap_check="off"))
    assert checked["generator_sha256"] == unchecked["generator_sha256"]  # a pass installs exactly what came
    assert checked["mdgan"]["swap_check"] == "on" and unchecked["mdgan"]["swap_check"] == "off"


def test_with_the_check_off_a_poisoned_push_is_installed(tmp_path):
    """(what the check is for: the same attack, unchecked, changes the run)"""
    from mdgan.algorithms.mdgan.options import MDGANOptions

    attacked, swaps = _run(tmp_path, "off", byzantine=1, attack="swap-zero", options=MDGANOptions(swap_check="off"))
    assert attacked["swaps_refused"] == 0 and all(w["received"] for s in swaps for w in s["workers"].values())
    clean, _ = _run(tmp_path, "clean")
    assert attacked["generator_sha256"] != clean["generator_sha256"]


def test_bad_check_settings_are_one_line(tmp_path):
    from mdgan.algorithms.mdgan.options import MDGANOptions

    for options, message in ((MDGANOptions(swap_check_norm_ratio=1.0), "norm_ratio must be a number > 1"),
                             (MDGANOptions(swap_check_min_cosine=2.0), "min_cosine must be in"),
                             (MDGANOptions(swap_check_loss_ratio=0.5), "loss_ratio must be a number >= 1"),
                             (MDGANOptions(swap_check="maybe"), "swap_check must be one of")):
        with pytest.raises(ConfigError, match=message):
            _run(tmp_path, "bad", options=options)


def test_an_honest_discriminator_refused_for_its_direction_says_what_to_do(tmp_path):
    """At a high learning rate honest discriminators drift apart and fail the direction check alone (the
    paper's MD-GAN Adam setting refused every swap of a Figure 3 run): the refusal says so and names the
    flag. Here a demanding threshold stands in for the drift; a sign-flipped D gets no such hint."""
    from mdgan.algorithms.mdgan.options import MDGANOptions

    summary, swaps = _run(tmp_path, "strict", options=MDGANOptions(swap_check_min_cosine=0.999999))
    refusals = [w["refused"] for s in swaps for w in s["workers"].values() if "refused" in w]
    assert summary["swaps_refused"] == len(refusals) > 0
    assert all(r.startswith("its weights point away") and "lower --swap-check-min-cosine" in r for r in refusals)
    _, swaps = _run(tmp_path, "flipped", byzantine=1, attack="swap-sign-flip")
    refusals = [w["refused"] for s in swaps for w in s["workers"].values() if "refused" in w]
    assert refusals and not any("--swap-check-min-cosine" in r for r in refusals)
