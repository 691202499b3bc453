"""Differentially private discriminators (mdgan/privacy.py), the membership-inference audit
(mdgan/audit.py) and their refusals: what a site that cares about its data sees."""

from __future__ import annotations

import io
import json
import os
import re
import shutil

import numpy as np
import pytest
import torch

from conftest import REPO
from mdgan.config import ConfigError, DataConfig, PrivacySpec, TrainingConfig
from mdgan.data import load_shard
from mdgan.gan import DiscriminatorSide, GeneratorSide
from mdgan.privacy_ledger import PrivacyLedger
from mdgan.secret_noise import SiteSecret

from procs import mdgan, read_json, read_jsonl, start_server, start_worker


def _side(privacy: PrivacySpec, seed: int = 0, iterations: int = 100) -> DiscriminatorSide:
    config = TrainingConfig(workers=2, batch_size=8, iterations=iterations, seed=seed, privacy=privacy).validate()
    return DiscriminatorSide(config, load_shard(DataConfig("synthetic", num_shards=2), 0))


def _batch(seed: int = 0):
    config = TrainingConfig(workers=2, batch_size=8, seed=seed).validate()
    return GeneratorSide(config).generate(1).for_worker(0)


def test_a_private_step_clips_noises_and_accounts_and_is_repeatable():
    batch = _batch()
    sides = [_side(PrivacySpec(noise_multiplier=1.1, max_grad_norm=0.5, fixed_noise=9)) for _ in range(2)]
    results = [[side.step(batch) for _ in range(5)] for side in sides]
    # the same fixed noise, the same noise and Poisson draws: bit for bit
    for a, b in zip(*(s.discriminator.state_dict().values() for s in sides)):
        assert torch.equal(a, b)
    assert all(r.fixed_noise for r in results[0])
    secret = [_side(PrivacySpec(noise_multiplier=1.1, max_grad_norm=0.5)) for _ in range(2)]
    for side in secret:  # the same seed and settings, each with a secret of its own: different noise
        assert not side.step(batch).fixed_noise
    assert not all(torch.equal(a, b) for a, b in zip(*(s.discriminator.state_dict().values() for s in secret)))
    eps = [r.epsilon for r in results[0]]
    assert all(e2 > e1 > 0 for e1, e2 in zip(eps, eps[1:]))  # every step spends
    assert results[0][-1].delta == pytest.approx(min(1e-5, 1 / (10 * len(sides[0].sampler.shard))))
    from opacus.accountants import RDPAccountant

    reference = RDPAccountant()  # Opacus's own accountant, stepped as many times, agrees
    for _ in range(5):
        reference.step(noise_multiplier=1.1, sample_rate=8 / len(sides[0].sampler.shard))
    assert eps[-1] == pytest.approx(reference.get_epsilon(results[0][-1].delta), rel=1e-12)
    plain = _side(PrivacySpec())
    plain.step(batch)
    assert plain.private is None and np.isnan(plain.step(batch).epsilon)


def test_the_collapse_bench_measures_the_norms_dp_sgd_clips():
    """bench/dp_collapse.py's per-sample gradient norms are the ones Opacus's ghost clipping scales by: with
    C far below every norm, the clipping factor is C / norm."""
    import importlib.util

    from mdgan.gan import discriminator_term

    spec_ = importlib.util.spec_from_file_location("dp_collapse", os.path.join(REPO, "bench", "dp_collapse.py"))
    bench = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(bench)
    clip = 1e-6
    side = _side(PrivacySpec(noise_multiplier=1.0, max_grad_norm=clip))
    disc, spec = side.discriminator, side.spec
    batch = _batch()
    real, real_labels = side.sampler.shard.images[:6], side.sampler.shard.labels[:6]
    fake, fake_labels = batch.discriminated[:6], batch.discriminated_labels[:6]
    for images, labels, is_real in ((real, real_labels, True), (fake, fake_labels, False)):
        whole, _, bias = bench.per_sample_norms(disc, spec, images, labels, real=is_real)
        losses = discriminator_term(spec, disc(images), labels, real=is_real, reduction="none").detach()
        clipped = side.private._clipped_losses(
            lambda: discriminator_term(spec, disc(images), labels, real=is_real, reduction="none")).detach()
        for p in disc.parameters():
            p.grad = None
        assert torch.allclose(whole, (clip * losses / clipped).double(), rtol=1e-4)
        assert bool((bias < 0).all()) if is_real else bool((bias > 0).all())
    row = bench.look(side, batch.discriminated, batch.discriminated_labels, 0, clip)
    assert row["real_clipped"] == row["fake_clipped"] == 1.0
    assert row["real_push"] > 0 > row["fake_push"]  # the real part moves the bias up, the generated part down


def test_the_collapse_bench_trains_the_run_simulate_trains(tmp_path):
    """bench/dp_collapse.py's looks leave the run alone: its generator is the one `mdgan simulate` makes."""
    import subprocess
    import sys

    flags = ["--dataset", "synthetic", "--iterations", "6", "--workers", "2", "--batch-size", "8", "--dp-fixed-noise", "1"]
    looked = subprocess.run([sys.executable, "bench/dp_collapse.py", "--every", "2", "--json", str(tmp_path / "l.json"),
                             "--", *flags], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert len(read_json(str(tmp_path / "l.json"))["looks"]) == 3
    mdgan("simulate", "--architecture", "mlp", "--gan", "acgan", "--dp-target-epsilon", "10", "--eval-every", "-1",
          "--threads", "1", "--no-progress", "--out", str(tmp_path / "plain"), *flags)
    sha = read_json(str(tmp_path / "plain" / "summary.json"))["generator_sha256"]
    assert f"generator sha256 {sha[:16]}" in looked, looked[-500:]


def _private_steps(noise_multiplier: float, max_grad_norm: float):
    from mdgan.privacy import PrivateSteps, SitePrivacy

    torch.manual_seed(3)
    disc = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LeakyReLU(0.2), torch.nn.Linear(8, 3))
    site = SitePrivacy(noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm, delta=1e-5, sample_rate=0.5,
                       planned_steps=1)
    optimizer = torch.optim.SGD(disc.parameters(), lr=0.0)
    return disc, PrivateSteps(disc, optimizer, site, batch_size=4,
                              ledger=PrivacyLedger.open(None, "", 0, "sgd", fixed_noise=11))


def _clipped_sum_over_b(disc, x: torch.Tensor, max_grad_norm: float, b: int) -> list[torch.Tensor]:
    """sum_i min(1, C / ||g_i||) g_i / b of the loss ||disc(x_i)||^2, each sample's gradient made one at a
    time; both kinds of sample (clipped and not) must be in x."""
    parameters = list(disc.parameters())
    expected = [torch.zeros_like(p) for p in parameters]
    clipped = 0
    for i in range(len(x)):
        grads = torch.autograd.grad(disc(x[i:i + 1]).pow(2).sum(), parameters)
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        factor = min(1.0, max_grad_norm / (float(norm) + 1e-6))
        clipped += factor < 1.0
        for e, g in zip(expected, grads):
            e += factor * g / b
    assert 0 < clipped < len(x)
    return expected


def test_a_private_step_sums_each_samples_clipped_gradient_and_divides_by_b():
    """The real part's .grad is sum_i min(1, C / ||g_i||) g_i / b over the sampled images: each sample's
    gradient made one at a time here, against the norms Opacus's ghost clipping finds without them."""
    disc, private = _private_steps(noise_multiplier=0.0, max_grad_norm=2.0)
    x = torch.randn(5, 6) * torch.tensor([[0.01], [0.1], [1.0], [3.0], [10.0]])  # norms below and above C

    def losses():
        return disc(x).pow(2).sum(dim=1)  # (5,)

    parameters = list(disc.parameters())
    expected = _clipped_sum_over_b(disc, x, max_grad_norm=2.0, b=4)
    private.real_step(parameters, losses)
    for p, e in zip(parameters, expected):
        torch.testing.assert_close(p.grad, e, rtol=1e-5, atol=1e-7)


def test_clipping_the_generated_part_adds_each_generated_samples_clipped_gradient_over_b_without_noise():
    """--dp-clip-generated: after the real part (noise included), the generated part adds
    sum_j min(1, C / ||g_j||) g_j / b, each generated sample's gradient made one at a time here; the real
    part's .grad, noise and all, is kept as it was."""
    disc, private = _private_steps(noise_multiplier=1.5, max_grad_norm=2.0)
    real = torch.randn(3, 6)
    fake = torch.randn(4, 6) * torch.tensor([[0.01], [1.0], [3.0], [10.0]])  # norms below and above C
    parameters = list(disc.parameters())
    private.real_step(parameters, lambda: disc(real).pow(2).sum(dim=1))
    real_part = [p.grad.clone() for p in parameters]
    expected = _clipped_sum_over_b(disc, fake, max_grad_norm=2.0, b=4)
    private.generated_step(parameters, lambda: disc(fake).pow(2).sum(dim=1))
    for p, r, e in zip(parameters, real_part, expected):
        torch.testing.assert_close(p.grad - r, e, rtol=1e-4, atol=1e-6)
    assert private.ledger.steps_taken == 1  # the generated part spends nothing


def test_a_discriminator_step_with_the_generated_part_clipped_differs_and_is_repeatable():
    """The switch reaches the worker's DP-SGD step (its weights differ from the unclipped step's), two
    sites given the same seeds and fixed noise end alike, and the epsilon spent is the same as without it."""
    batch = _batch()
    plain = _side(PrivacySpec(noise_multiplier=1.1, max_grad_norm=0.1, clip_generated=False, fixed_noise=1))
    sides = [_side(PrivacySpec(noise_multiplier=1.1, max_grad_norm=0.1, fixed_noise=1))
             for _ in range(2)]  # (clipped by default)
    results = [[side.step(batch) for _ in range(3)] for side in (plain, *sides)]
    for a, b in zip(*(s.discriminator.state_dict().values() for s in sides)):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(plain.discriminator.state_dict().values(),
                                                     sides[0].discriminator.state_dict().values()))
    assert [r.epsilon for r in results[0]] == [r.epsilon for r in results[1]]
    assert all(torch.isfinite(torch.as_tensor(r.disc_loss)) for r in results[1])


def _simulate_args(*flags: str):
    from mdgan_app.cli import build_parser

    args = build_parser().parse_args(["simulate", *flags])
    args.given = set()
    return args


@pytest.mark.parametrize("flags, env, clipped", [
    ([], None, False),  # not private: nothing to clip
    (["--dp-noise-multiplier", "1"], None, True),  # DP-SGD: on unless said otherwise
    (["--dp-target-epsilon", "5"], None, True),
    (["--dp-noise-multiplier", "1", "--no-dp-clip-generated"], None, False),
    (["--dp-noise-multiplier", "1"], "false", False),
    (["--dp-noise-multiplier", "1", "--dp-clip-generated"], "false", True),  # a flag over its variable
    (["--dp-noise-multiplier", "1", "--dp-mechanism", "feedback"], None, False),  # no DP-SGD step to clip
    (["--no-dp-clip-generated"], None, False),  # (says what a run without DP does)
])
def test_the_generated_part_is_clipped_by_default_with_dp_sgd_and_the_run_records_what_it_did(
        flags, env, clipped, monkeypatch, tmp_path):
    import tomllib

    from mdgan_app.run_folder import save_launch_settings
    from services.common.settings import training_config

    if env is not None:
        monkeypatch.setenv("MDGAN_SIMULATE_DP_CLIP_GENERATED", env)
    args = _simulate_args("--dataset", "synthetic", "--workers", "2", "--out", str(tmp_path), *flags)
    assert training_config(args).privacy.clip_generated is clipped
    save_launch_settings(args)  # what --resume and --config take again: the value, not "the default"
    assert tomllib.loads((tmp_path / "launch.toml").read_text())["dp-clip-generated"] is clipped


def test_print_config_leaves_a_derived_setting_unset_and_says_what_it_comes_to(capsys):
    """Unset in the printed file (a --config made from it and given DP later still clips), with its value."""
    from mdgan_app.cli import main

    for flags, line in (([], "# dp-clip-generated =  (unset: false "),
                        (["--dp-noise-multiplier", "1"], "# dp-clip-generated =  (unset: true "),
                        (["--dp-noise-multiplier", "1", "--no-dp-clip-generated"], "dp-clip-generated = false")):
        with pytest.raises(SystemExit) as done:
            main(["simulate", "--print-config", *flags])
        assert done.value.code in (0, None)
        printed = [l for l in capsys.readouterr().out.splitlines() if "dp-clip-generated" in l]
        assert len(printed) == 1 and printed[0].startswith(line), printed


def test_a_run_recorded_before_the_generated_part_was_clipped_by_default_goes_on_unclipped(tmp_path):
    """A DP-SGD run recorded without the key (an older mdgan: launch.toml, the checkpointed config, an
    experiment's run.json) trained the generated part unclipped, and is resumed, read and compared so."""
    from mdgan.run import open_run
    from mdgan_app.experiment import _differing, expand, recorded_run
    from mdgan_app.run_folder import take_launch_settings
    from services.common.settings import training_config

    private = TrainingConfig(workers=2, privacy=PrivacySpec(noise_multiplier=1.0)).validate()
    record = private.to_dict()
    del record["privacy"]["clip_generated"]
    assert TrainingConfig.from_dict(record).privacy.clip_generated is False
    assert TrainingConfig.from_dict(private.to_dict()).privacy.clip_generated is True

    run = tmp_path / "run"
    open_run(str(run), private)
    for launched, clipped in (("dp-noise-multiplier = 1.0\n", False),
                              ("dp-noise-multiplier = 1.0\ndp-clip-generated = true\n", True)):
        (run / "launch.toml").write_text(launched)
        args = _simulate_args("--resume", str(run))
        take_launch_settings(args)
        assert training_config(args).privacy.clip_generated is clipped, launched
    args = _simulate_args("--resume", str(run), "--dp-clip-generated")  # given: the command's own
    args.given = {"dp_clip_generated"}
    take_launch_settings(args)
    assert training_config(args).privacy.clip_generated is True

    [now] = expand({"name": "x", "out": "x", "runs": [{"dp_noise_multiplier": 1.0}]})
    old = {k: v for k, v in now.items() if k != "dp_clip_generated"}
    assert now["dp_clip_generated"] is True and recorded_run(old)["dp_clip_generated"] is False
    assert _differing(old, now) == ["dp_clip_generated"]  # a kept unclipped run is not taken for a clipped one
    assert _differing(old, {**now, "dp_clip_generated": False}) == []
    [plain] = expand({"name": "x", "out": "x", "runs": [{}]})
    assert _differing({k: v for k, v in plain.items() if k != "dp_clip_generated"}, plain) == []


def test_an_empty_poisson_sample_is_the_noise_alone_drawn_from_the_sites_secret():
    disc, private = _private_steps(noise_multiplier=2.0, max_grad_norm=0.5)
    parameters = list(disc.parameters())
    private.real_step(parameters, lambda: None)
    # step 0's draw of the site's noise stream: N(0, (sigma C)^2) a coordinate, over b, in the parameters' order
    draws = SiteSecret.from_fixed(11, 0).stream("dp-sgd/noise").normal(0, sum(p.numel() for p in parameters), 1.0)
    for p, drawn in zip(parameters, torch.split(draws, [p.numel() for p in parameters])):
        torch.testing.assert_close(p.grad, drawn.float().view_as(p) / 4, rtol=0, atol=0)
    assert private.ledger.steps_taken == 1  # counted, so the next step draws the next noise
    private.real_step(parameters, lambda: None)
    assert not torch.equal(parameters[0].grad, draws[:parameters[0].numel()].float().view_as(parameters[0]) / 4)


def test_the_noise_is_the_privacy_a_clipped_noiseless_step_would_not_have():
    """The same seeds and draws at two noise levels give different weights: the noise really
    reaches them (were it dropped, both steps would be the same)."""
    batch = _batch()
    before = _side(PrivacySpec(noise_multiplier=1e-6)).discriminator.state_dict()
    quiet, loud = _side(PrivacySpec(noise_multiplier=1e-6, fixed_noise=2)), _side(PrivacySpec(noise_multiplier=50.0,
                                                                                              fixed_noise=2))
    quiet.step(batch)
    loud.step(batch)
    moved = {name: float((loud.discriminator.state_dict()[name] - quiet.discriminator.state_dict()[name]).abs().max())
             for name in before}
    assert max(moved.values()) > 0  # different noise, different weights (Adam normalises the size)


def test_the_ledger_not_the_checkpoint_holds_what_a_site_spent(tmp_path):
    """A checkpoint restored into a site winds back its D, never its ledger: the steps taken after the checkpoint
    were released, and stay counted; the next step draws noise no step drew before."""
    from mdgan.privacy_ledger import PrivacyLedger

    batch = _batch()
    spec = PrivacySpec(noise_multiplier=1.0)
    config = TrainingConfig(workers=2, batch_size=8, iterations=100, privacy=spec).validate()
    shard = load_shard(DataConfig("synthetic", num_shards=2), 0)
    first = DiscriminatorSide(config, shard, PrivacyLedger.open(str(tmp_path), "run", 0, "sgd"))
    for _ in range(2):
        first.step(batch)
    buffer = io.BytesIO()  # as a checkpoint on disk holds it (state_dict() shares the live tensors)
    torch.save(first.state_dict(), buffer)
    for _ in range(2):
        first.step(batch)
    spent = first.private.epsilon()
    again = DiscriminatorSide(config, shard, PrivacyLedger.open(str(tmp_path), "run", 0, "sgd"))  # a restart
    again.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    assert again.private.ledger.steps_taken == 4 and again.private.epsilon() == spent  # never wound back
    assert again.step(batch).epsilon > spent
    with pytest.raises(ValueError, match="without DP"):
        _side(PrivacySpec(noise_multiplier=1.0)).load_state_dict(_side(PrivacySpec()).state_dict())


def test_a_checkpoint_from_before_ledgers_starts_the_ledger_from_its_accountant():
    from mdgan.privacy_ledger import PrivacyLedger, adopt_old_accountant

    ledger = PrivacyLedger.open(None, "run", 0, "sgd")
    adopt_old_accountant(ledger, {"accountant": [[1.0, 0.008, 7]], "noise": None, "sampling": None})
    assert ledger.steps_taken == 7
    adopt_old_accountant(ledger, {"accountant": [[1.0, 0.008, 2]]})  # a ledger that counts is never wound back
    assert ledger.steps_taken == 7


def _files(folder) -> dict[str, bytes]:
    """Every file under `folder`, by its path there: what a refused command must leave as it was."""
    found = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as fh:
                found[os.path.relpath(path, folder)] = fh.read()
    return found


SMALL_RUN = ["--workers", "2", "--iterations", "4", "--dataset", "synthetic", "--eval-every", "-1", "--no-progress"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished `mdgan simulate` run: its folder, and every file in it."""
    from mdgan_app.cli import main

    out = tmp_path_factory.mktemp("finished") / "run"
    assert main(["simulate", *SMALL_RUN, "--out", str(out)]) == 0
    return out, _files(out)


def _refused_in_one_line(capsys, code: int, message: str) -> None:
    stderr = capsys.readouterr().err
    assert code == 2, stderr
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and re.search(message, lines[0]), stderr


@pytest.mark.parametrize("flags, message", [
    (["--dp-target-epsilon", "0.01"], r"--dp-target-epsilon 0.01: no noise reaches it"),
    (["--dp-noise-multiplier", "1", "--dp-delta", "0.01"], r"--dp-delta 0.01 must be in \(0, 1/m\)"),
    (["--dp-noise-multiplier", "1", "--dp-delta", "0.001"], r"--dp-delta 0.001 must be in \(0, 1/m\)"),  # = 1/m
    (["--dp-noise-multiplier", "0"], r"--dp-noise-multiplier must be > 0"),
    (["--dp-noise-multiplier", "-2"], r"--dp-noise-multiplier must be > 0"),
    (["--dp-noise-multiplier", "1", "--algorithm", "pwgan"], r"implemented for mdgan, flgan, standalone only, not "
                                                              r"--algorithm pwgan"),
    (["--dp-noise-multiplier", "1", "--architecture", "cnn-mnist"], r"MinibatchDiscrimination has no per-sample gradient"),
    (["--dp-noise-multiplier", "1", "--dp-target-epsilon", "2"], r"not both"),
    (["--disc-width", "0"], r"--disc-width must be between 1 and 8,192, got 0"),
    (["--disc-width", "64", "--architecture", "cnn-mnist"], r"--disc-width sets the MLP discriminator's width"),
    (["--dp-clip-generated"], r"--dp-clip-generated clips DP-SGD's discriminator steps"),
    (["--dp-clip-generated", "--dp-mechanism", "feedback", "--dp-noise-multiplier", "1"],
     r"--dp-clip-generated clips DP-SGD's discriminator steps: it needs --dp-mechanism sgd"),
])
@pytest.mark.parametrize("command", ["simulate", "local"])
def test_a_refused_setting_is_one_line_and_touches_no_run_folder(tmp_path, capsys, finished_run, command,
                                                                        flags, message):
    """Refused before anything is written: a new --out is not made, a finished run's is left byte for byte
    (before, simulate wrote launch.toml and run_identity.json and removed summary.json, then refused)."""
    from mdgan_app.cli import main

    new = tmp_path / "new"
    _refused_in_one_line(capsys, main([command, *SMALL_RUN, "--out", str(new), *flags]), message)
    assert not new.exists()
    folder, files = finished_run
    kept = tmp_path / "finished"
    shutil.copytree(folder, kept)
    # refused for the setting, or first for the finished run; and where replacing it was asked for, for the setting
    for overwrite, refusal in (([], f"{message}|holds a finished run"), (["--overwrite"], message)):
        _refused_in_one_line(capsys, main([command, *SMALL_RUN, "--out", str(kept), *flags, *overwrite]), refusal)
        assert _files(kept) == files


@pytest.mark.parametrize("command", ["simulate", "local"])
def test_a_finished_run_is_replaced_only_when_asked_and_never_resumed(tmp_path, capsys, finished_run, command):
    from mdgan_app.cli import main

    folder, files = finished_run
    kept = tmp_path / "finished"
    shutil.copytree(folder, kept)
    _refused_in_one_line(capsys, main([command, *SMALL_RUN, "--out", str(kept)]),
                         r"holds a finished run \(summary.json\): give --overwrite to replace it")
    _refused_in_one_line(capsys, main([command, "--resume", str(kept), "--no-progress"]),
                         r"has finished \(summary.json\); nothing to resume")
    assert _files(kept) == files


def test_overwrite_replaces_a_finished_run_and_remembers_it_ended(tmp_path, finished_run):
    from mdgan_app.cli import main

    folder, files = finished_run
    kept = tmp_path / "finished"
    shutil.copytree(folder, kept)
    old = read_json(kept / "run_identity.json")["run_id"]
    assert main(["simulate", *SMALL_RUN, "--iterations", "3", "--out", str(kept), "--overwrite"]) == 0
    summary = read_json(kept / "summary.json")
    assert summary["iterations"] == 3 and summary["run_id"] not in (None, old)
    assert read_json(kept / "finished_runs.json") == [old]


@pytest.mark.filterwarnings("ignore:Optimal order is the largest alpha")
def test_the_sigma_a_target_epsilon_chose_is_recorded_for_each_site(tmp_path):
    from opacus.accountants.utils import get_noise_multiplier

    from mdgan.run import EvaluationOptions
    from mdgan.simulation import simulate

    config = TrainingConfig(workers=3, iterations=5, batch_size=8, swap_every=3,
                            privacy=PrivacySpec(target_epsilon=4.0)).validate()
    summary = simulate(config, DataConfig("synthetic"), str(tmp_path / "run"), progress=False,
                       evaluation=EvaluationOptions(every=-1))
    recorded = summary["privacy"]["noise_multipliers"]
    assert set(recorded) == set(summary["worker_sizes"]) == {"worker-0", "worker-1", "worker-2"}
    for worker, size in summary["worker_sizes"].items():
        delta = summary["privacy"]["sites"][worker]["delta"]
        assert recorded[worker] == pytest.approx(get_noise_multiplier(
            target_epsilon=4.0, target_delta=delta, sample_rate=8 / size, steps=5, accountant="rdp",
            epsilon_tolerance=0.01), rel=1e-12)
    shared = set(recorded.values())  # (sites of 667, 667 and 666 samples: Opacus's search may land on one sigma)
    assert summary["privacy"]["noise_multiplier"] == (shared.pop() if len(shared) == 1 else None)


def test_a_private_site_judges_an_incoming_discriminator_on_generated_samples_only():
    from mdgan.algorithms.mdgan import swapcheck

    side = _side(PrivacySpec(noise_multiplier=1.0))
    side.step(_batch())
    real, real_labels, fake, _ = swapcheck._check_set(side, 64)
    assert real is None and real_labels is None and fake is not None
    assert swapcheck.check_incoming(side, side.export_state(), swapcheck.SwapCheck()).refused == ""


# -- over the services --------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("algorithm, switch, clip_generated", [("mdgan", [], True),  # (one D step for both)
                                                               ("flgan", ["--no-dp-clip-generated"], False)])
def test_a_private_run_over_grpc_ends_where_simulate_ends_and_reports_each_sites_epsilon(tmp_path, algorithm, switch,
                                                                                         clip_generated, device):
    """The generated part is clipped by default with DP-SGD, and --no-dp-clip-generated reaches the server and its
    workers through `mdgan local` too."""
    flags = ["--workers", "2", "--iterations", "12", "--swap-every", "4", "--seed", "5", "--batch-size", "8",
             "--dataset", "synthetic", "--dp-noise-multiplier", "1.3", "--dp-max-grad-norm", "0.7", "--no-progress",
             "--algorithm", algorithm, "--device", device, "--dp-fixed-noise", "3", *switch]
    runs = {}
    for mode in ("simulate", "local"):
        out = tmp_path / mode
        mdgan(mode, *flags, "--out", str(out))
        runs[mode] = read_json(out / "summary.json")
    assert runs["local"]["generator_sha256"] == runs["simulate"]["generator_sha256"]
    for summary in runs.values():
        privacy = summary["privacy"]
        assert set(privacy["sites"]) == {"worker-0", "worker-1"}
        assert privacy["epsilon_max"] > 0 and privacy["noise_multiplier"] == 1.3 and privacy["sampling"] == "poisson"
        assert privacy["clip_generated"] is clip_generated
    assert runs["local"]["privacy"]["sites"] == runs["simulate"]["privacy"]["sites"]
    history = read_jsonl(tmp_path / "local" / "history.jsonl")
    assert history[-1]["privacy"] == runs["local"]["privacy"]["sites"]
    assert [r["iteration"] for r in history if "privacy" in r] == [4, 8, 12]  # swap lines and the last
    for worker in ("worker-0", "worker-1"):
        with open(tmp_path / "local" / "metrics" / f"{worker}.prom") as fh:
            gauge = float(re.search(r"^mdgan_privacy_epsilon (\S+)$", fh.read(), re.M).group(1))
        assert gauge == pytest.approx(runs["local"]["privacy"]["sites"][worker]["epsilon"])


@pytest.mark.slow
def test_a_site_leaves_rather_than_spend_past_its_own_budget(tmp_path):
    out = str(tmp_path / "grpc")
    flags = ["--workers", "2", "--iterations", "60", "--seed", "2", "--batch-size", "8", "--dp-noise-multiplier", "2.0",
             "--min-workers", "1", "--insecure"]
    server, port = start_server(out, *flags)
    budget = 0.2  # (at sigma 2 and q = 8/1000 about the 35th step's: RDP spends 0.18 at the first)
    workers = [start_worker(out, port, 0, 2, "--dataset", "synthetic", "--insecure", "--privacy-dir",
                            os.path.join(out, "site-0")),
               start_worker(out, port, 1, 2, "--dataset", "synthetic", "--insecure", "--dp-max-epsilon", str(budget),
                            "--metrics-dump", os.path.join(out, "worker-1.prom"), "--privacy-dir",
                            os.path.join(out, "site-1"))]
    try:
        assert workers[1].wait(180) == 0, workers[1].log()
        assert server.wait(180) == 0, server.log()
        assert workers[0].wait(60) == 0, workers[0].log()
    finally:
        for p in [server, *workers]:
            p.kill()
    log = workers[1].log()
    assert re.search(r"leaving the run: iteration \d+: privacy budget spent: the next step would bring this site's "
                     r"epsilon to [\d.]+, past --dp-max-epsilon 0.2", log), log
    with open(os.path.join(out, "worker-1.prom")) as fh:
        spent = float(re.search(r"^mdgan_privacy_epsilon (\S+)$", fh.read(), re.M).group(1))
    assert 0 < spent <= budget  # it stopped before, not after, going past
    summary = read_json(os.path.join(out, "summary.json"))
    assert summary["iterations"] == 60 and summary["workers_alive"] == 1
    assert summary["privacy"]["sites"]["worker-1"]["epsilon"] <= budget
    # the server was told why (and does not wait for it to come back)
    assert re.search(r"worker-1 failed while answering batches: iteration \d+: privacy budget spent", server.log()), \
        server.log()


# -- the audit ----------------------------------------------------------------------------------------

def test_the_statistics_of_the_audit():
    from mdgan.audit import attack_statistics, roc_auc, tpr_at_fpr

    assert roc_auc(np.array([3.0, 4.0]), np.array([1.0, 2.0])) == 1.0
    assert roc_auc(np.array([1.0, 2.0]), np.array([3.0, 4.0])) == 0.0
    assert roc_auc(np.array([1.0, 1.0]), np.array([1.0, 1.0])) == 0.5  # ties count half
    rng = np.random.default_rng(0)
    same = attack_statistics(rng.normal(size=2000), rng.normal(size=2000), 100, 0)
    assert 0.45 < same["auc"] < 0.55 and same["auc_ci"][0] < 0.5 < same["auc_ci"][1]
    apart = rng.normal(3, 1, size=2000)
    assert tpr_at_fpr(apart, rng.normal(size=2000), 0.01) > 0.5


@pytest.mark.slow
def test_an_audit_of_a_run_whose_split_cannot_be_recovered_is_one_line(tmp_path, capsys):
    from mdgan.audit import audit
    from mdgan_app.cli import main

    (tmp_path / "run").mkdir()
    with pytest.raises(ConfigError, match="no summary.json"):
        audit(str(tmp_path / "run"))
    assert main(["simulate", "--workers", "2", "--iterations", "2", "--dataset", "synthetic", "--no-progress",
                 "--out", str(tmp_path / "syn")]) == 0
    summary = read_json(tmp_path / "syn" / "summary.json")
    summary.pop("data")  # as an older mdgan recorded it
    with open(tmp_path / "syn" / "summary.json", "w") as fh:
        json.dump(summary, fh)
    capsys.readouterr()
    assert main(["audit", str(tmp_path / "syn")]) == 2
    stderr = capsys.readouterr().err
    assert "does not record its data split" in stderr and len(stderr.strip().splitlines()) == 1, stderr


@pytest.mark.slow
def test_the_audit_sees_a_memorising_run_leak_and_dp_stop_it(tmp_path):
    """Two sites of 16 images each, trained far past memorisation: the discriminator attack reads
    membership off D clearly; with DP at epsilon 1 it does much worse (docs/PRIVACY.md has the numbers).
    (sigma is given: the one a target epsilon of 1 finds for these sites, whose search is tested apart.)"""
    from mdgan.audit import AuditSettings, audit
    from mdgan.run import EvaluationOptions
    from mdgan.simulation import Outputs, simulate

    data = DataConfig("mnist", os.path.join(REPO, "..", "shared", "data"), max_samples=32)
    if not os.path.isdir(os.path.join(data.data_root, "MNIST")):
        pytest.skip("MNIST is not beside the repository")
    aucs = {}
    for name, privacy in (("plain", PrivacySpec()), ("private", PrivacySpec(noise_multiplier=MEMORISE_SIGMA))):
        config = TrainingConfig(workers=2, iterations=MEMORISE_ITERATIONS, batch_size=8, disc_steps=2, seed=1,
                                privacy=privacy).validate()
        simulate(config, data, str(tmp_path / name), progress=False, evaluation=EvaluationOptions(every=-1),
                 outputs=Outputs(save_discriminators=True))
        report = audit(str(tmp_path / name), AuditSettings(members=16, nonmembers=500, generated=1000, bootstrap=50))
        aucs[name] = report["summary"]["d_class_loss"]["auc_mean"]
        if privacy.enabled:
            assert report["privacy"]["epsilon_max"] <= 1.0 + 1e-6
    assert aucs["plain"] >= 0.75, aucs
    assert aucs["private"] <= aucs["plain"] - 0.1, aucs


MEMORISE_ITERATIONS = 120  # 60 epochs of 16 images: far past memorisation (AUC 0.92 plain, 0.55 at epsilon 1)
MEMORISE_SIGMA = 31.6  # above the 31.5625 that --dp-target-epsilon 1 chooses for these sites: epsilon 0.99


def test_a_site_that_leaves_and_rejoins_keeps_spending_from_its_saved_budget(tmp_path):
    """Churn in one process: worker-1 leaves after iteration 10 and comes back after 20 with its saved
    state (checkpoints every 5): its accountant counts the steps it took, before and after, no more."""
    from opacus.accountants import RDPAccountant

    from mdgan.run import EvaluationOptions
    from mdgan.simulation import Durability, Emulation, simulate

    config = TrainingConfig(workers=2, iterations=30, batch_size=8, swap_every=5, seed=4,
                            privacy=PrivacySpec(noise_multiplier=1.5)).validate()
    summary = simulate(config, DataConfig("synthetic"), str(tmp_path / "run"), progress=False,
                       evaluation=EvaluationOptions(every=-1), durability=Durability(checkpoint_every=5),
                       emulation=Emulation(churn=[(10, "leave", 1), (20, "join", 1)]))
    sites = summary["privacy"]["sites"]
    history = read_jsonl(tmp_path / "run" / "history.jsonl")
    steps = {"worker-0": 30, "worker-1": sum(1 for r in history if r["active_workers"] == 2)}
    assert 10 <= steps["worker-1"] < 30
    for worker, count in steps.items():
        accountant = RDPAccountant()
        for _ in range(count):
            accountant.step(noise_multiplier=1.5, sample_rate=8 / summary["worker_sizes"][worker])
        assert sites[worker]["epsilon"] == pytest.approx(accountant.get_epsilon(sites[worker]["delta"]), rel=1e-9)
    assert sites["worker-1"]["epsilon"] < sites["worker-0"]["epsilon"]


def test_the_baselines_train_their_discriminators_privately_too(tmp_path):
    """FL-GAN's workers and the standalone GAN train their D by the same DP-SGD (each site's accountant
    counts its own steps); P-WGAN and the parameter-server GAN are refused (above)."""
    from opacus.accountants import RDPAccountant

    from mdgan.run import EvaluationOptions
    from mdgan.simulation import simulate

    for algorithm, steps in (("standalone", 6), ("flgan", 6)):
        config = TrainingConfig(workers=2, iterations=6, batch_size=8, swap_every=3, seed=2,
                                privacy=PrivacySpec(noise_multiplier=1.2)).validate()
        summary = simulate(config, DataConfig("synthetic"), str(tmp_path / algorithm), progress=False,
                           evaluation=EvaluationOptions(every=-1), algorithm=algorithm)
        sites = summary["privacy"]["sites"]
        assert set(sites) == set(summary["worker_sizes"])
        for worker, site in sites.items():
            accountant = RDPAccountant()
            for _ in range(steps):
                accountant.step(noise_multiplier=1.2, sample_rate=8 / summary["worker_sizes"][worker])
            assert site["epsilon"] == pytest.approx(accountant.get_epsilon(site["delta"]), rel=1e-9)


class _Oracle(torch.nn.Module):
    """A 'generator' that returns real MNIST training images: of the class asked for (honest), or of
    another class (lying): what the downstream score must tell apart."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, honest: bool):
        super().__init__()
        from mdgan.config import ModelSpec

        self.spec = ModelSpec()
        self.by_class = [images[labels == c] for c in range(10)]
        self.honest, self.drawn = honest, 0

    def forward(self, z: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # (n, 784) in [-1, 1]
        out = []
        for label in labels.tolist():
            pool = self.by_class[label if self.honest else (label + 1) % 10]
            out.append(pool[self.drawn % len(pool)])
            self.drawn += 1
        return torch.stack(out)


@pytest.mark.slow
def test_downstream_accuracy_is_high_for_true_labelled_images_and_chance_for_noise(tmp_path, capsys):
    """`mdgan score RUN --downstream`: a classifier trained on a generator's labelled images, tested on
    real MNIST: about 90% and more when the images are real and their labels right, chance when the
    labels are wrong or the generator untrained; a plain GAN (no labels) is one line."""
    from mdgan.data import load_mnist
    from mdgan.downstream import downstream_accuracy
    from mdgan_app.cli import main

    data_root = os.path.join(REPO, "..", "shared", "data")
    if not os.path.isdir(os.path.join(data_root, "MNIST")):
        pytest.skip("MNIST is not beside the repository")
    images, labels = load_mnist(data_root, train=True)
    honest = downstream_accuracy(_Oracle(images, labels, True), data_root, samples=2000, epochs=2)
    lying = downstream_accuracy(_Oracle(images, labels, False), data_root, samples=2000, epochs=2)
    assert honest.accuracy > 0.85 and lying.accuracy < 0.2, (honest, lying)
    assert honest.samples == 2000 and honest.test_images == 10000

    out = tmp_path / "untrained"
    assert main(["simulate", "--algorithm", "standalone", "--iterations", "0", "--data-root", data_root,
                 "--eval-every", "-1", "--no-progress", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["score", str(out), "--data-root", data_root, "--samples", "200", "--downstream",
                 "--downstream-samples", "500", "--downstream-epochs", "1"]) == 0
    scores = json.loads(capsys.readouterr().out)
    assert scores == read_json(out / "scores.json")
    assert {"mnist_score", "fid", "downstream_accuracy"} <= set(scores) and scores["downstream_samples"] == 500
    assert scores["downstream_accuracy"] < 0.3, scores
    assert main(["simulate", "--gan", "gan", "--algorithm", "standalone", "--iterations", "0", "--data-root", data_root,
                 "--eval-every", "-1", "--no-progress", "--out", str(tmp_path / "plain")]) == 0
    capsys.readouterr()
    assert main(["score", str(tmp_path / "plain"), "--data-root", data_root, "--downstream"]) == 2
    assert "needs a class-conditional generator" in capsys.readouterr().err


def test_the_server_refuses_a_finished_run_or_a_setting_before_it_writes(tmp_path, finished_run, caplog):
    """mdgan-server, as compose or a pod starts it on a folder whose run finished: exit 2, the run left byte
    for byte, unless --overwrite (MDGAN_OVERWRITE) asks for a new run there; a DP setting it cannot train
    is refused before the folder is touched either way."""
    from services.server.__main__ import main as server

    folder, files = finished_run
    kept = tmp_path / "finished"
    shutil.copytree(folder, kept)
    base = ["--insecure", "--listen", "127.0.0.1:0", "--metrics-port", "0", "--workers", "2", "--out", str(kept)]
    assert server(base) == 2
    assert "holds a finished run (summary.json): give --overwrite" in caplog.text
    assert server([*base, "--overwrite", "--dp-noise-multiplier", "1", "--architecture", "cnn-mnist"]) == 2
    assert "MinibatchDiscrimination has no per-sample gradient" in caplog.text
    assert _files(kept) == files
