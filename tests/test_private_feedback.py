"""Private feedback (--dp-mechanism feedback, mdgan/algorithms/mdgan/private_feedback.py): only clipped,
noised feedback leaves a site, each answer from one of its discriminators, each accounted per part."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from mdgan.privacy_ledger import LedgerError, PrivacyLedger
from mdgan import privacy
from mdgan.algorithms.mdgan.private_feedback import FeedbackMechanism, PrivateFeedbackSide, split_parts
from mdgan.config import ConfigError, DataConfig, PrivacySpec, TrainingConfig
from mdgan.data import load_shard
from mdgan.gan import GeneratorSide

from procs import read_jsonl

pytestmark = pytest.mark.filterwarnings("ignore:Optimal order is the")


def _config(parts: int = 3, iterations: int = 30, **privacy_settings) -> TrainingConfig:
    settings = {"noise_multiplier": 2.0, "max_grad_norm": 0.5, **privacy_settings}
    return TrainingConfig(workers=2, batch_size=8, iterations=iterations, seed=3, privacy=PrivacySpec(
        mechanism="feedback", discriminators=parts, **settings)).validate()


def _shard():
    return load_shard(DataConfig("synthetic", num_shards=2), 0)


def _batches(count: int):
    generator = GeneratorSide(TrainingConfig(workers=2, batch_size=8, seed=1).validate())
    return [generator.generate(1).for_worker(0) for _ in range(count)]


def test_each_answer_depends_on_the_part_that_gave_it_and_on_no_other():
    """Two sites whose data differ in one image: every answer given by a part without that image is the
    same bit for bit, and the answers of its own part are not (the argument's parallel composition)."""
    config, shard = _config(), _shard()
    parts = split_parts(shard, 3, 0)  # disjoint, covering the shard, sizes within one
    assert sum(len(p) for p in parts) == len(shard) and max(map(len, parts)) - min(map(len, parts)) <= 1
    config = dataclasses.replace(config, privacy=dataclasses.replace(config.privacy, fixed_noise=4))  # same noise
    plain = PrivateFeedbackSide(config, shard)
    holder = 1
    first = plain.parts[holder].sampler.state_dict()["order"][0]  # the first image part 1 trains on
    image = plain.parts[holder].shard.images[first]
    index = next(i for i in range(len(shard)) if torch.equal(shard.images[i], image))
    changed = dataclasses.replace(shard, images=shard.images.clone())
    changed.images[index] = -changed.images[index]
    sides = [plain, PrivateFeedbackSide(config, changed)]
    same, differ = 0, 0
    for batch in _batches(12):
        drawn = sides[0].private.next_part()
        a, b = (side.step(batch) for side in sides)
        if drawn == holder:
            differ += not torch.equal(a.feedback, b.feedback)
        else:
            assert torch.equal(a.feedback, b.feedback)
            same += 1
    assert same == 8 and differ == 4  # each of the 3 parts answered 4 of the 12 requests


def test_rows_are_clipped_to_c_and_noised_with_std_sigma_c():
    def mechanism(sigma):
        site = privacy.SitePrivacy(sigma, 0.5, 1e-5, 1.0, 10, mechanism="feedback", discriminators=1,
                                   accounted_noise_multiplier=sigma / 2)
        return FeedbackMechanism(site, PrivacyLedger.open(None, "", 0, "feedback"))

    rows = torch.zeros(4, 1, 28, 28)
    rows[0, 0, 0, :3] = torch.tensor([3.0, 4.0, 0.0])  # norm 5: clipped to 0.5
    rows[1, 0, 5, 5] = 0.2  # inside C: left as it is
    clipped = mechanism(0.0).sanitize(rows).reshape(4, -1).norm(dim=1)
    assert clipped[0] == pytest.approx(0.5, rel=1e-5) and clipped[1] == pytest.approx(0.2, rel=1e-5)
    assert clipped[2] == 0
    noise = mechanism(3.0).sanitize(torch.zeros(500, 784))
    assert noise.std().item() == pytest.approx(1.5, rel=0.01)  # sigma x C


def test_each_part_answers_in_turn_and_epsilon_is_opacus_rdp_over_the_busiest_part():
    from opacus.accountants import RDPAccountant

    side = PrivateFeedbackSide(_config(parts=3), _shard())
    results = [side.step(batch) for batch in _batches(7)]
    assert sorted(side.private.answers) == [2, 2, 3]  # a fresh order of the 3 parts every 3 requests
    site = side.private.site
    assert site.accounted_noise_multiplier == pytest.approx(2.0 / (2 * 8 ** 0.5))  # sigma / (2 sqrt(b))
    reference = RDPAccountant()  # Opacus's own accountant: 3 Gaussian steps at sampling rate 1
    for _ in range(3):
        reference.step(noise_multiplier=site.accounted_noise_multiplier, sample_rate=1.0)
    assert results[-1].epsilon == pytest.approx(reference.get_epsilon(site.delta), rel=1e-12)
    assert [r.epsilon for r in results[:3]] == [results[0].epsilon] * 3  # one answer of each part: one step's
    assert results[3].epsilon > results[2].epsilon
    for batch in _batches(5):  # what --dp-max-epsilon checks before an answer is what the answer spends
        ahead = side.private.epsilon_after_iteration()
        assert side.step(batch).epsilon == ahead


def test_a_target_epsilon_is_what_the_planned_run_spends():
    config = _config(parts=5, iterations=50, noise_multiplier=0.0, target_epsilon=4.0)
    side = PrivateFeedbackSide(config, _shard())
    assert side.private.site.planned_steps == 10  # ceil(50 / 5) answers of each part
    for batch in _batches(50):
        side.step(batch)
    assert side.private.answers == [10] * 5
    assert 3.9 <= side.private.epsilon() <= 4.0


def test_no_discriminator_leaves_or_enters_a_private_feedback_site():
    side = PrivateFeedbackSide(_config(), _shard())
    for action in (side.export_state, side.state_layout, lambda: side.import_state({}), lambda: side.adopt({})):
        with pytest.raises(PermissionError, match="never leave"):
            action()


def test_a_checkpointed_site_with_its_ledger_goes_on_bit_for_bit(tmp_path):
    """A site restarted from its checkpoint and its ledger (fixed noise, to compare) answers as one that never
    stopped; a checkpoint never winds the ledger back."""
    config, shard = _config(), _shard()
    config = dataclasses.replace(config, privacy=dataclasses.replace(config.privacy, fixed_noise=4))
    batches = _batches(10)
    straight = PrivateFeedbackSide(config, shard)
    expected = [straight.step(b).feedback for b in batches]
    first = PrivateFeedbackSide(config, shard, PrivacyLedger.open(str(tmp_path), "run", 0, "feedback", 3, 4))
    for b in batches[:4]:
        first.step(b)
    resumed = PrivateFeedbackSide(config, shard, PrivacyLedger.open(str(tmp_path), "run", 0, "feedback", 3, 4))
    resumed.load_state_dict(first.state_dict())
    for b, want in zip(batches[4:], expected[4:]):
        assert torch.equal(resumed.step(b).feedback, want)
    assert resumed.private.answers == straight.private.answers
    with pytest.raises(LedgerError, match="3, this site has 2|counts 3 discriminators, this site has 2"):
        PrivacyLedger.open(str(tmp_path), "run", 0, "feedback", 2, 4)
    other = PrivateFeedbackSide(_config(parts=2), shard)
    with pytest.raises(ValueError, match="3 discriminators, this site has 2"):
        other.load_state_dict(first.state_dict())


def test_a_run_swaps_nothing_and_a_rejoining_site_starts_fresh_instead_of_a_copy(tmp_path):
    """In one process with churn: no swaps, no worker-to-worker byte, and worker-1, back after leaving
    without saved state, takes no copy of a peer's discriminator (it would wait for one forever)."""
    from mdgan.run import EvaluationOptions
    from mdgan.simulation import Emulation, simulate

    config = dataclasses.replace(_config(parts=2, iterations=24), workers=3).validate()
    summary = simulate(config, DataConfig("synthetic"), str(tmp_path / "run"), progress=False,
                       evaluation=EvaluationOptions(every=-1),
                       emulation=Emulation(churn=[(8, "leave", 1), (14, "join", 1)]))
    assert summary["iterations"] == 24 and summary["swaps"] == 0 and summary["swap_period"] is None
    assert summary["payload_bytes"]["worker_to_worker"] == 0
    from mdgan.algorithms.mdgan import per_worker_per_iteration

    assert per_worker_per_iteration(config, 600)["worker_to_worker"] == 0  # Table III without swaps
    sites = summary["privacy"]["sites"]
    assert sites["worker-1"]["epsilon"] < sites["worker-0"]["epsilon"]  # it answered fewer requests
    assert summary["privacy"]["mechanism"] == "feedback" and summary["privacy"]["discriminators"] == 2
    history = read_jsonl(tmp_path / "run" / "history.jsonl")
    assert [r["active_workers"] for r in history if r["iteration"] in (8, 10, 24)] == [3, 2, 3]


@pytest.mark.parametrize("flags, message", [
    (["--dp-mechanism", "feedback", "--dp-noise-multiplier", "1", "--algorithm", "flgan"],
     r"--dp-mechanism feedback is implemented for mdgan only, not --algorithm flgan"),
    (["--dp-mechanism", "feedback"], r"--dp-mechanism feedback needs --dp-noise-multiplier or --dp-target-epsilon"),
    (["--dp-discriminators", "2", "--dp-noise-multiplier", "1"],
     r"--dp-discriminators 2 needs --dp-mechanism feedback"),
    (["--dp-mechanism", "feedback", "--dp-noise-multiplier", "1", "--dp-discriminators", "0"],
     r"--dp-discriminators must be a whole number >= 1"),
    (["--dp-mechanism", "feedback", "--dp-noise-multiplier", "1", "--dp-discriminators", "200"],
     r"--dp-discriminators 200: a site of 1000 samples split into 200 parts has parts of 5, fewer than a batch"),
    (["--dp-mechanism", "feedback", "--dp-noise-multiplier", "1", "--swap-every", "2"], r"there are no swaps"),
    (["--dp-mechanism", "feedback", "--dp-noise-multiplier", "1", "--swap-lag", "1"], r"no swaps to lag"),
    (["--dp-mechanism", "laplace", "--dp-noise-multiplier", "1"], r"invalid choice: 'laplace'"),
])
@pytest.mark.parametrize("command", ["simulate", "local"])
def test_a_private_feedback_setting_it_cannot_have_is_one_line_and_writes_nothing(tmp_path, capsys, command, flags,
                                                                                   message):
    from mdgan_app.cli import main

    out = tmp_path / "run"
    try:
        code = main([command, "--workers", "2", "--iterations", "4", "--dataset", "synthetic", "--eval-every", "-1",
                     "--no-progress", "--out", str(out), *flags])
    except SystemExit as exc:  # (argparse's own refusals)
        code = exc.code
    stderr = capsys.readouterr().err
    assert code == 2, stderr
    assert re.search(message, stderr) and not out.exists(), stderr


def test_the_settings_travel_to_the_workers():
    from services.common import codec, training_spec

    config = _config(parts=4)
    spec = training_spec.spec_from_config(config)
    assert (spec.dp_mechanism, spec.dp_discriminators) == ("feedback", 4)
    assert training_spec.config_from_spec(spec).privacy == config.privacy
    with pytest.raises(ConfigError, match="dp_mechanism must be one of"):
        spec.dp_mechanism = "laplace"
        training_spec.config_from_spec(spec)
