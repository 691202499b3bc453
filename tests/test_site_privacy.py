"""Differential privacy that holds against the server and the other sites (docs/PRIVACY.md, "Who is trusted with
what"): each site's noise comes from a secret of its own (mdgan/secret_noise.py), a ledger of its own counts every
release before it leaves (mdgan/privacy_ledger.py), and no statistic computed on its real images is in its messages.
Each test plays the attacker or the failure the guarantee must survive."""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os

import pytest
import torch

from conftest import REPO
from mdgan.algorithms.mdgan.private_feedback import PrivateFeedbackSide
from mdgan.config import DataConfig, PrivacySpec, TrainingConfig
from mdgan.data import load_shard
from mdgan.gan import DiscriminatorSide, GeneratorSide, derive_seed
from mdgan.privacy_ledger import LedgerError, PrivacyLedger
from mdgan.run import EvaluationOptions
from mdgan.secret_noise import SecretStream, SiteSecret
from mdgan.simulation import Durability, Emulation, simulate

from procs import mdgan, read_json, start_server, start_worker

pytestmark = pytest.mark.filterwarnings("ignore:Optimal order is the")
FAULTS = os.path.join(REPO, "tests", "faults")
C = 0.1


def _shard(index: int = 0):
    return load_shard(DataConfig("synthetic", num_shards=2), index)


def _batches(count: int, batch_size: int = 8):
    generator = GeneratorSide(TrainingConfig(workers=2, batch_size=batch_size, seed=1).validate())
    return [generator.generate(1).for_worker(0) for _ in range(count)]


def _seed_feedback_noise(seed: int, site: int, answer: int, shape: tuple, std: float) -> torch.Tensor:
    """The noise of a site's answer `answer` as whoever knows the run's seed computed it while the noise was drawn
    from the run's seed: the seeded generator's draw of that answer."""
    generator = torch.Generator().manual_seed(derive_seed(seed, "dp-feedback-noise", site))
    for _ in range(answer):
        torch.normal(0.0, std, size=shape, generator=generator)
    return torch.normal(0.0, std, size=shape, generator=generator)


def _rows_without(feedback: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The norms of an answer's rows with `noise` taken off: (b,), each at most C when the noise is the answer's
    (rows are clipped to C), about 4 C when it is not. The feedback sent is the answer over b."""
    b = len(feedback)
    return (feedback.double().reshape(b, -1) * b - noise.double().reshape(b, -1)).norm(dim=1)


# -- the noise: nobody else can compute it ----------------------------------------------------------------------

@pytest.mark.parametrize("fixed", [None, 6], ids=["secret", "fixed"])
def test_the_server_cannot_take_a_sites_feedback_noise_off(fixed):
    """Playing the server, which knows the run's seed and every setting: the seed-derived noise taken off a site's
    answers gives back its clipped rows (each of norm C) only where the noise came from the seed. With a secret it
    gives rows of norm ~4 C; with --dp-fixed-noise, whoever knows the number takes the noise off exactly."""
    config = TrainingConfig(workers=2, batch_size=8, iterations=30, seed=3, privacy=PrivacySpec(
        noise_multiplier=1.0, max_grad_norm=C, mechanism="feedback", fixed_noise=fixed)).validate()
    side = PrivateFeedbackSide(config, _shard())
    twin = PrivateFeedbackSide(config, _shard(), PrivacyLedger(None, "", 0, "feedback", side.private.ledger.secret))
    twin.private.noise = _NoNoise()  # the same answers without their noise: the clipped rows, over b
    for answer, batch in enumerate(_batches(3)):
        feedback = side.step(batch).feedback  # (8, 784): what the server receives
        clipped = twin.step(batch).feedback.double().reshape(8, -1) * 8
        shape = (len(feedback), feedback[0].numel())
        assert (clipped.norm(dim=1) <= C * 1.0001).all() and (clipped.norm(dim=1) > C / 2).any()
        by_seed = _rows_without(feedback, _seed_feedback_noise(config.seed, 0, answer, shape, C))
        assert (by_seed > 2 * C).all(), by_seed  # not the clipped rows: the seed says nothing of the noise
        if fixed is not None:
            known = SiteSecret.from_fixed(fixed, 0).stream("feedback/noise").normal(answer, shape[0] * shape[1], C)
            recovered = feedback.double().reshape(8, -1) * 8 - known.reshape(8, -1)
            torch.testing.assert_close(recovered, clipped, rtol=0, atol=1e-5)


class _NoNoise(SecretStream):
    def __init__(self):
        super().__init__(bytes(32))

    def normal(self, index: int, n: int, std: float = 1.0) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.float64)


@pytest.mark.parametrize("fixed", [None, 6], ids=["secret", "fixed"])
def test_the_noise_of_a_dp_sgd_step_is_not_the_runs_seeds(fixed):
    """The noise a DP-SGD step added to D's gradient (the step taken twice from one state, with and without it)
    against the noise the seed gave before sites had secrets (Opacus's draws from a generator seeded by the run's
    seed and the shard): unrelated. Under --dp-fixed-noise it is exactly draw 0 of the number's stream."""
    config = TrainingConfig(workers=2, batch_size=8, iterations=30, seed=3, privacy=PrivacySpec(
        noise_multiplier=1.0, max_grad_norm=1.0, fixed_noise=fixed)).validate()
    side = DiscriminatorSide(config, _shard())
    twin = DiscriminatorSide(config, _shard(), PrivacyLedger(None, "", 0, "sgd", side.private.ledger.secret))
    twin.private.noise = _NoNoise()
    batch = _batches(1)[0]
    side.step(batch)
    twin.step(batch)
    params = [(p, q) for p, q in zip(side.discriminator.parameters(), twin.discriminator.parameters())]
    added = torch.cat([((p.grad - q.grad) * config.batch_size).flatten() for p, q in params]).double()  # (P,)
    seeded = torch.Generator().manual_seed(derive_seed(config.seed, "dp-noise", 0))
    by_seed = torch.cat([torch.normal(0.0, 1.0, size=p.shape, generator=seeded).flatten() for p, _ in params]).double()
    assert added.std() == pytest.approx(1.0, rel=0.01)  # sigma C: the noise is there
    assert abs(torch.corrcoef(torch.stack([added, by_seed]))[0, 1]) < 0.01
    if fixed is not None:
        known = SiteSecret.from_fixed(fixed, 0).stream("dp-sgd/noise").normal(0, added.numel(), 1.0)
        torch.testing.assert_close(added, known, rtol=0, atol=1e-4)


def test_two_runs_with_the_same_seed_under_dp_end_on_different_generators_unless_the_noise_is_fixed(tmp_path):
    config = TrainingConfig(workers=2, iterations=6, batch_size=8, seed=2, privacy=PrivacySpec(noise_multiplier=1.0))
    runs = {}
    for name, fixed in (("a", None), ("b", None), ("c", 5), ("d", 5)):
        summary = simulate(dataclasses.replace(config, privacy=dataclasses.replace(config.privacy, fixed_noise=fixed)),
                           DataConfig("synthetic"), str(tmp_path / name), progress=False,
                           evaluation=EvaluationOptions(every=-1))
        runs[name] = summary
    assert runs["a"]["generator_sha256"] != runs["b"]["generator_sha256"]
    assert runs["c"]["generator_sha256"] == runs["d"]["generator_sha256"]
    assert runs["a"]["privacy"]["noise"] == "secret" and runs["c"]["privacy"]["noise"] == "fixed"
    assert {s["noise"] for s in runs["c"]["privacy"]["sites"].values()} == {"fixed"}
    for name in "ab":  # the secret is in the site's ledger only (its owner's to read): not in what the run writes
        [path] = glob.glob(str(tmp_path / name / "sites" / "worker-0" / "privacy" / "*" / "site-0.json"))
        ledger = read_json(path)
        assert os.stat(path).st_mode & 0o777 == 0o600
        for written in ("summary.json", "history.jsonl", "run_identity.json"):
            assert ledger["secret"] not in (tmp_path / name / written).read_text()


# -- the ledger: every release counted, no noise twice ----------------------------------------------------------

def _draws(monkeypatch) -> list[tuple[bytes, int]]:
    """Every (stream, index) drawn from a site's secret in this process, in order."""
    drawn = []
    normal, uniform = SecretStream.normal, SecretStream.uniform
    monkeypatch.setattr(SecretStream, "normal",
                        lambda self, index, n, std=1.0: drawn.append((self._key, "n", index)) or normal(self, index, n, std))
    monkeypatch.setattr(SecretStream, "uniform",
                        lambda self, index, n: drawn.append((self._key, "u", index)) or uniform(self, index, n))
    return drawn


def _opacus_epsilon(history: list[tuple[float, float, int]], delta: float) -> float:
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    for sigma, q, steps in history:
        for _ in range(steps):
            accountant.step(noise_multiplier=sigma, sample_rate=q)
    return accountant.get_epsilon(delta)


def _ledger(out, site: int) -> dict:
    [path] = glob.glob(os.path.join(str(out), "**", "privacy", "*", f"site-{site}.json"), recursive=True)
    with open(path) as fh:
        return json.load(fh)


def _site_epsilon(ledger: dict, summary: dict, worker: str) -> float:
    """What Opacus's accountant says the ledger's releases spend."""
    privacy = summary["privacy"]
    delta = privacy["sites"][worker]["delta"]
    if ledger["mechanism"] == "feedback":
        return _opacus_epsilon([(privacy["accounted_noise_multipliers"][worker], 1.0, max(ledger["answers"]))], delta)
    return _opacus_epsilon([tuple(s) for s in ledger["steps"]], delta)


@pytest.mark.parametrize("mechanism", ["sgd", "feedback"])
def test_a_site_that_leaves_and_rejoins_without_checkpoints_counts_every_step_and_draws_no_noise_twice(
        tmp_path, monkeypatch, mechanism):
    """--churn leave:10:1,join:20:1 and no checkpoints: worker-1 comes back with nothing of its run but its ledger.
    (Before ledgers: its first 10 answers after the rejoin carried the noise of its first 10, and it reported the
    epsilon of 10 steps for 20.)"""
    drawn = _draws(monkeypatch)
    config = TrainingConfig(workers=2, iterations=30, batch_size=8, seed=4, swap_every=None if mechanism == "feedback"
                            else 5, privacy=PrivacySpec(noise_multiplier=1.5, max_grad_norm=C, mechanism=mechanism))
    summary = simulate(config.validate(), DataConfig("synthetic"), str(tmp_path), progress=False,
                       evaluation=EvaluationOptions(every=-1), emulation=Emulation(churn=[(10, "leave", 1),
                                                                                          (20, "join", 1)]))
    ledger = _ledger(tmp_path, 1)
    taken = sum(s[2] for s in ledger["steps"]) + sum(ledger["answers"])
    assert taken == 20  # iterations 1-10 and 21-30
    assert summary["privacy"]["sites"]["worker-1"]["epsilon"] == pytest.approx(
        _site_epsilon(ledger, summary, "worker-1"), rel=1e-9)
    assert len(drawn) == len(set(drawn))  # no draw of any stream of any site made twice


@pytest.mark.parametrize("algorithm", ["flgan", "standalone"])
def test_the_baselines_sites_keep_ledgers_too(tmp_path, algorithm):
    """FL-GAN's sites and the standalone GAN's one site count their DP-SGD steps in ledgers of their own, and
    report the epsilon Opacus computes over them; two runs of one seed draw different noise."""
    config = TrainingConfig(workers=2, iterations=6, batch_size=8, swap_every=3, seed=2,
                            privacy=PrivacySpec(noise_multiplier=1.0)).validate()
    hashes = []
    for name in ("a", "b"):
        summary = simulate(config, DataConfig("synthetic"), str(tmp_path / name), progress=False, algorithm=algorithm,
                           evaluation=EvaluationOptions(every=-1))
        hashes.append(summary["generator_sha256"])
        for worker in summary["privacy"]["sites"]:
            ledger = _ledger(tmp_path / name, int(worker.rsplit("-", 1)[1]))
            assert sum(s[2] for s in ledger["steps"]) == 6
            assert summary["privacy"]["sites"][worker]["epsilon"] == pytest.approx(
                _site_epsilon(ledger, summary, worker), rel=1e-9)
    assert hashes[0] != hashes[1]


def _crash_at(monkeypatch, iteration: int):
    from mdgan.algorithms.mdgan import trainer

    original = trainer.Trainer.iteration

    async def crashing(self, t):
        if t == iteration:
            raise RuntimeError(f"the process dies at iteration {iteration}")
        return await original(self, t)

    monkeypatch.setattr(trainer.Trainer, "iteration", crashing)
    return lambda: monkeypatch.setattr(trainer.Trainer, "iteration", original)


@pytest.mark.parametrize("target", [None, 2.0], ids=["sigma", "target-epsilon"])
def test_a_resumed_run_counts_the_steps_it_takes_again_and_a_site_stops_at_its_budget(tmp_path, monkeypatch, target):
    """A run dies at iteration 14 and resumes from its checkpoint of iteration 10: the sites' D go back to 10, their
    ledgers do not (iterations 11-13 were released). With a sigma, each site counts 13 + 10 steps. With
    --dp-target-epsilon, which is also a cap, each site stops before the step that would pass it, says so, and the
    run, left without workers, ends saying so."""
    drawn = _draws(monkeypatch)
    privacy = PrivacySpec(target_epsilon=target) if target else PrivacySpec(noise_multiplier=1.0)
    config = TrainingConfig(workers=2, iterations=20, batch_size=8, swap_every=5, seed=4, privacy=privacy).validate()
    run = dict(data=DataConfig("synthetic"), out_dir=str(tmp_path), progress=False,
               evaluation=EvaluationOptions(every=-1))
    restore = _crash_at(monkeypatch, 14)
    with pytest.raises(RuntimeError, match="dies at iteration 14"):
        simulate(config, durability=Durability(checkpoint_every=5), **run)
    restore()
    summary = simulate(config, durability=Durability(checkpoint_every=5, resume="yes"), **run)
    assert summary["resumed_from"] == 10
    for site in (0, 1):
        ledger = _ledger(tmp_path, site)
        steps = sum(s[2] for s in ledger["steps"])
        reported = summary["privacy"]["sites"][f"worker-{site}"]["epsilon"]
        assert reported == pytest.approx(_site_epsilon(ledger, summary, f"worker-{site}"), rel=1e-9)
        if target is None:
            assert steps == 13 + 10
        else:
            assert steps == 20 and reported <= target  # the planned 20 steps spend the target: no more
    if target is not None:
        assert summary["workers_alive"] == 0
        last = 10 + (20 - 13)  # the resumed iterations a site's 20 planned steps leave it after the 13 it took
        assert summary["stopped_early"] == (f"no workers left after iteration {last + 1}: worker-0, worker-1 stopped "
                                            "at their privacy budget")  # (iteration last + 1 found them spent)
    assert len(drawn) == len(set(drawn))


def test_a_damaged_or_foreign_ledger_is_refused_in_one_line_and_the_run_left_as_it_was(tmp_path, capsys):
    out = tmp_path / "run"
    flags = ["--workers", "2", "--iterations", "10", "--dataset", "synthetic", "--eval-every", "-1", "--no-progress",
             "--dp-noise-multiplier", "1", "--checkpoint-every", "5"]
    mdgan("simulate", *flags, "--dp-fixed-noise", "3", "--out", str(out))
    os.remove(out / "summary.json")  # as if it had died before its end (resumable)
    [path] = glob.glob(str(out / "sites" / "worker-1" / "privacy" / "*" / "site-1.json"))
    with open(path, "w") as fh:
        fh.write("{not json")
    done = mdgan("simulate", *flags, "--resume", str(out), check=False)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "site-1.json is unreadable" in lines[0], done.stderr
    for escape in ("../escape", "..", "."):
        with pytest.raises(LedgerError, match="cannot name a privacy ledger"):
            PrivacyLedger.open(str(tmp_path), escape, 0, "sgd")
    # a site that began with a fixed noise cannot go on with a secret one, nor the other way round
    PrivacyLedger.open(str(tmp_path), "r", 0, "sgd", fixed_noise=3)
    for fixed in (None, 4):
        with pytest.raises(LedgerError, match="this site began run 'r' with that --dp-fixed-noise"):
            PrivacyLedger.open(str(tmp_path), "r", 0, "sgd", fixed_noise=fixed)
    PrivacyLedger.open(str(tmp_path), "s", 0, "sgd")
    with pytest.raises(LedgerError, match="this site began run 's' without"):
        PrivacyLedger.open(str(tmp_path), "s", 0, "sgd", fixed_noise=3)
    with pytest.raises(LedgerError, match="is the ledger of run 's', site 0, mechanism sgd"):
        PrivacyLedger.open(str(tmp_path), "s", 0, "feedback")


@pytest.mark.parametrize("flags, message", [
    (["--dp-fixed-noise", "3"], "--dp-fixed-noise fixes a private run's noise"),
    (["--dp-fixed-noise", "-1", "--dp-noise-multiplier", "1"], "--dp-fixed-noise must be a whole number >= 0")])
def test_a_fixed_noise_without_dp_or_below_zero_is_refused(tmp_path, flags, message):
    done = mdgan("simulate", "--dataset", "synthetic", "--iterations", "2", "--out", str(tmp_path / "x"), *flags,
                 check=False)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert not (tmp_path / "x").exists()


# -- over gRPC: what the server receives ----------------------------------------------------------------------

def _recorded(path: str, kind: str = "Feedback"):
    """The messages of type `kind` recorded, in order."""
    from services.common.proto import coordinator_pb2 as pb

    messages = []
    with open(path, "rb") as fh:
        data = fh.read()
    while data:
        size = int.from_bytes(data[:4], "little")
        messages.append(getattr(pb, kind).FromString(data[4:4 + size]))
        data = data[4 + size:]
    return messages


def _env(tmp_path, *faults: dict) -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([FAULTS, REPO, os.environ.get("PYTHONPATH", "")]),
                MDGAN_TEST_FAULT=json.dumps(list(faults)))


RECORD = "services.server.algorithms.mdgan:GrpcWorker._on_feedback"


@pytest.mark.slow
@pytest.mark.parametrize("algorithm, mechanism, sent", [("mdgan", "feedback", set()),
                                                        ("mdgan", "sgd", {"gen_loss", "fake_accuracy"}),
                                                        ("flgan", "sgd", {"gen_loss", "fake_accuracy"})])
def test_over_grpc_the_server_receives_no_real_data_statistic_and_cannot_take_the_noise_off(tmp_path, algorithm,
                                                                                           mechanism, sent):
    """Every message with statistics the server received (recorded in the server process, as it read them): under
    DP-SGD only what the private D says of generated samples, under private feedback nothing but the noised answer
    and the site's (epsilon, delta); and the seed-derived noise taken off the answers gives no clipped row."""
    from services.common import codec

    record = str(tmp_path / "received-{worker}.bin")
    flags = ["--workers", "2", "--iterations", "8", "--batch-size", "8", "--seed", "3", "--dataset", "synthetic",
             "--dp-noise-multiplier", "1.0", "--dp-max-grad-norm", str(C), "--dp-mechanism", mechanism,
             "--eval-every", "-1", "--no-progress", "--insecure", "--algorithm", algorithm,
             "--out", str(tmp_path / "run")]
    if mechanism == "sgd":
        flags += ["--swap-every", "4"]
    target = RECORD if algorithm == "mdgan" else "services.server.algorithms.flgan:GrpcFederatedWorker." \
                                                    "_on_local_round_done"
    mdgan("local", *flags, env=_env(tmp_path, {"target": target, "record": record}))
    summary = read_json(tmp_path / "run" / "summary.json")
    assert set(summary["privacy"]["withheld"]) == {"disc_loss", "gen_loss", "real_accuracy", "fake_accuracy"} - sent
    for site in (0, 1):
        messages = _recorded(record.format(worker=f"worker-{site}"),
                             "Feedback" if algorithm == "mdgan" else "LocalRoundDone")
        stats = [m.stats for m in messages] if algorithm == "mdgan" else [s for m in messages for s in m.stats]
        assert len(stats) == 8
        for each in stats:
            carried = {field.name for field, _ in each.ListFields()}
            assert carried <= sent | {"epsilon", "delta"} and {"epsilon", "delta"} <= carried, carried
        if mechanism == "feedback":
            for answer, message in enumerate(messages):
                feedback = codec.decode_packed(message.gradient, shape=(8, 784), wire_dtype="float32")
                by_seed = _rows_without(feedback, _seed_feedback_noise(3, site, answer, (8, 784), C))
                assert (by_seed > 2 * C).all()
    history = [json.loads(line) for line in (tmp_path / "run" / "history.jsonl").read_text().splitlines()]
    assert all(row["disc_loss"] is None and row["real_accuracy"] is None for row in history)
    assert {s["noise"] for s in summary["privacy"]["sites"].values()} == {"secret"}


@pytest.mark.slow
def test_a_site_killed_between_its_ledger_and_its_send_and_restarted_without_state_reuses_no_noise(tmp_path):
    """worker-1 is SIGKILLed right after its ledger counted its 10th answer, before the answer left; it is started
    again without any state but its --privacy-dir, rejoins, and the run finishes. Read from what the server received
    (fixed noise, so that the test can take it off): every answer of worker-1 carries a noise draw of its own, the
    10th draw is in none (it was never sent), and the ledger counts the sent answers and the killed one; the
    epsilon the server reports is Opacus's over the ledger's answers."""
    from services.common import codec

    out = str(tmp_path / "run")
    record = str(tmp_path / "feedback-{worker}.bin")
    flags = ["--workers", "2", "--iterations", "40", "--seed", "3", "--batch-size", "8", "--dp-mechanism", "feedback",
             "--dp-noise-multiplier", "1.0", "--dp-max-grad-norm", str(C), "--insecure", "--min-workers", "2",
             "--pause-timeout", "120"]  # (the run waits for worker-1 to come back)
    server, port = start_server(out, *flags, env=_env(tmp_path, {"target": RECORD, "record": record}))
    site = ["--dataset", "synthetic", "--insecure", "--dp-fixed-noise", "7"]
    killed = {"target": "mdgan.privacy_ledger:PrivacyLedger.commit", "after": 10, "kill": True}  # (1: the ledger made)
    workers = [start_worker(out, port, 0, 2, *site, "--privacy-dir", str(tmp_path / "site-0")),
               start_worker(out, port, 1, 2, *site, "--privacy-dir", str(tmp_path / "site-1"), name="worker-1-first",
                            env=_env(tmp_path, killed))]
    try:
        assert workers[1].wait(120) == -9, workers[1].log()
        workers.append(start_worker(out, port, 1, 2, *site, "--privacy-dir", str(tmp_path / "site-1")))
        assert server.wait(180) == 0, server.log()
        for worker in (workers[0], workers[2]):
            assert worker.wait(60) == 0, worker.log()
    finally:
        for p in [server, *workers]:
            p.kill()
    summary = read_json(os.path.join(out, "summary.json"))
    ledger = _ledger(tmp_path / "site-1", 1)
    messages = _recorded(record.format(worker="worker-1"))
    answers = ledger["answers"][0]
    assert answers == len(messages) + 1 and len(messages) > 10  # the killed answer counted, never sent
    stream = SiteSecret.from_fixed(7, 1).stream("feedback/noise")
    used = []
    for sent, message in enumerate(messages):  # its draw: the answer's number, or one more after the kill
        feedback = codec.decode_packed(message.gradient, shape=(8, 784), wire_dtype="float32")
        used += [i for i in (sent, sent + 1)
                 if (_rows_without(feedback, stream.normal(i, 8 * 784, C)) <= C * 1.001).all()]
    assert len(used) == len(messages) == len(set(used)) and 9 not in used, used
    assert summary["privacy"]["sites"]["worker-1"]["epsilon"] == pytest.approx(
        _site_epsilon(ledger, summary, "worker-1"), rel=1e-9)
    assert summary["privacy"]["noise"] == "fixed"


# -- the audit: the server's view, one run, a lower bound on epsilon -------------------------------------------

def test_the_one_run_bound_holds_for_randomized_response_and_finds_a_weaker_one():
    """Canaries through epsilon-randomized response (its guesses right with probability e^eps / (1 + e^eps)
    exactly): over 60 audits the bound at 95% passes the true epsilon about 5% of the time, no more; the guesses of
    a mechanism three times weaker reject epsilon 1; chance rejects nothing."""
    from mdgan.privacy_audit import epsilon_lower_bound

    generator = torch.Generator().manual_seed(0)

    def audit(epsilon: float) -> float:
        right = int((torch.rand(400, generator=generator) < 1 / (1 + math.exp(-epsilon))).sum())
        return epsilon_lower_bound(800, 400, right, delta=1e-5)

    passed = sum(audit(1.0) > 1.0 for _ in range(60))
    assert passed <= 8  # (Binomial(60, 0.05) reaches 8 with probability 1.1%)
    assert audit(3.0) > 1.0
    assert epsilon_lower_bound(1000, 200, 100, delta=1e-5) == 0.0
    assert epsilon_lower_bound(1000, 200, 200, 1e-5) > epsilon_lower_bound(1000, 200, 190, 1e-5) > 0


@pytest.mark.parametrize("mechanism, flags", [
    ("feedback", ["--dp-mechanism", "feedback", "--dp-noise-multiplier", "60", "--iterations", "5"]),
    ("sgd", ["--dp-noise-multiplier", "2", "--iterations", "200"])])
def test_the_servers_view_audit_stays_at_chance_on_secret_noise_and_finds_a_fixed_one(tmp_path, mechanism, flags):
    """`mdgan audit RUN --server-view`: on a run with secret noise the attacker, holding the seed and the settings,
    guesses at chance and the bound is 0, at or below the accountant's; on a run whose noise the server can take
    off (--dp-fixed-noise, which it stores), every guess is right and the bound is far above the accountant's."""
    base = ["--workers", "2", "--batch-size", "8", "--dp-max-grad-norm", str(C), "--dataset", "synthetic",
            "--eval-every", "-1", "--no-progress", *flags]
    for fixed in ([], ["--dp-fixed-noise", "3"]):
        out = tmp_path / ("fixed" if fixed else "secret")
        mdgan("simulate", *base, *fixed, "--out", str(out))
        done = mdgan("audit", str(out), "--server-view", "--guesses", "300")
        report = read_json(out / "audit" / "server_view.json")
        assert "epsilon >=" in done.stdout and report["mechanism"] == mechanism
        for site in report["sites"]:
            if fixed:
                assert site["noise_known"] and site["correct"] == site["guesses"] == 300
                assert site["epsilon_lower_bound"] > 4 * max(site["canary_epsilon"], site["run_epsilon"])
            else:
                assert not site["noise_known"] and site["correct"] < 0.6 * site["guesses"]
                assert site["epsilon_lower_bound"] <= min(site["canary_epsilon"], site["run_epsilon"])


def test_the_servers_view_audit_refuses_what_it_cannot_audit(tmp_path):
    plain = tmp_path / "plain"
    mdgan("simulate", "--workers", "2", "--iterations", "2", "--dataset", "synthetic", "--eval-every", "-1",
          "--no-progress", "--out", str(plain))
    for flags, message in ((["--server-view"], "not a differentially private run"),
                           (["--server-view", "--site-data", "x", "--held-out", "y"], "not with a site's own audit")):
        done = mdgan("audit", str(plain), *flags, check=False)
        assert done.returncode == 2 and message in done.stderr, done.stderr
    assert not (plain / "audit").exists()


@pytest.mark.slow
def test_a_private_worker_without_a_folder_for_its_ledger_or_with_a_damaged_one_leaves_saying_why(tmp_path):
    out = str(tmp_path / "run")
    server, port = start_server(out, "--workers", "2", "--iterations", "5", "--dp-noise-multiplier", "1",
                                "--insecure", "--run-id", "r1")
    damaged = tmp_path / "site-1" / "privacy" / "r1" / "site-1.json"
    damaged.parent.mkdir(parents=True)
    damaged.write_text("{not json")
    workers = [start_worker(out, port, 0, 2, "--dataset", "synthetic", "--insecure"),
               start_worker(out, port, 1, 2, "--dataset", "synthetic", "--insecure", "--privacy-dir",
                            str(tmp_path / "site-1"))]
    try:
        codes = [w.wait(120) for w in workers]
    finally:
        for p in [server, *workers]:
            p.kill()
    assert codes == [2, 2], [w.log() for w in workers]
    assert "has no folder for its privacy ledger, which counts every step it releases: give --privacy-dir" \
        in workers[0].log()
    assert "cannot keep this site's privacy ledger: the privacy ledger" in workers[1].log()
    assert damaged.read_text() == "{not json"  # left as it was
