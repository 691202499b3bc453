import asyncio
import json

import pytest
import torch

from mdgan.algorithms.psgan import (PSGANTrainer, PSGANOptions, GradientOrder, InProcessReplica,
                                    ParameterServer, ReplicaSide, average, build_in_process_replicas,
                                    compute_gradients, traffic_per_iteration, weights)
from mdgan.config import ConfigError, DataConfig, ModelSpec, TrainingConfig
from mdgan.data import ShardSampler, load_all_shards
from mdgan.gan import GeneratorSide, derive_seed, discriminator_loss, generator_loss, make_adam
from mdgan.models import build_discriminator, build_generator
from mdgan.simulation import Emulation, simulate


def _config(**kw) -> TrainingConfig:
    base = dict(workers=3, iterations=3, batch_size=6, seed=4, model=ModelSpec(gan="gan"))
    base.update(kw)
    return TrainingConfig(**base).validate()


def plain_gan(config: TrainingConfig, shard, iterations: int):
    """Single-process GAN training written the plain way: per iteration one real batch and one fake
    batch; L steps of D on them, the last one simultaneous with G's step (both gradients at the same
    weights), with the worker's seeds."""
    spec = config.model
    G = build_generator(spec, derive_seed(config.seed, "generator-init"))
    D = build_discriminator(spec, derive_seed(config.seed, "discriminator-init"))
    g_opt, d_opt = make_adam(G, config.generator_optimizer), make_adam(D, config.discriminator_optimizer)
    sampler = ShardSampler(shard, config.batch_size, derive_seed(config.seed, "worker-sampling", shard.index))
    noise = torch.Generator().manual_seed(derive_seed(config.seed, "dpgan-noise", shard.index))
    for _ in range(iterations):
        real, real_labels = sampler.next_batch()
        z = torch.randn(config.batch_size, spec.latent_dim, generator=noise)
        labels = torch.randint(0, spec.num_classes, (config.batch_size,), generator=noise) if spec.conditional else None
        fake = G(z, labels)
        for step in range(1, config.disc_steps + 1):
            d_loss = discriminator_loss(spec, D(real), real_labels, D(fake.detach()), labels)
            d_opt.zero_grad()
            d_loss.backward(inputs=list(D.parameters()))
            if step == config.disc_steps:
                g_opt.zero_grad()
                generator_loss(spec, D(fake), labels).backward(inputs=list(G.parameters()))
                g_opt.step()
            d_opt.step()
    return G, D


@pytest.mark.parametrize("gan,disc_steps", [("gan", 1), ("acgan", 2)])
def test_one_worker_is_plain_single_process_training_bit_for_bit(gan, disc_steps):
    config = _config(workers=1, iterations=5, disc_steps=disc_steps, model=ModelSpec(gan=gan))
    (shard,) = load_all_shards(DataConfig("synthetic", num_shards=1))
    server = ParameterServer(config, GeneratorSide(config))
    asyncio.run(PSGANTrainer(config, PSGANOptions(), server, build_in_process_replicas(config, [shard])).run())
    G, D = plain_gan(config, shard, config.iterations)
    # Bit for bit: the same operations in the same order; a mean of one gradient is that gradient.
    for ours, plain in ((server.generator, G), (server.discriminator, D)):
        for (name, p), q in zip(ours.named_parameters(), plain.parameters()):
            assert torch.equal(p, q), name
    assert not torch.equal(next(G.parameters()), next(build_generator(config.model, derive_seed(config.seed, "generator-init")).parameters()))


@pytest.mark.parametrize("gan", ["gan", "acgan"])
def test_averaged_gradients_of_k_workers_are_the_gradient_on_the_union_batch(gan):
    """Holds for models whose output for a sample ignores the rest of its batch (the MLPs; not
    minibatch discrimination nor BatchNorm in training mode): the losses are means over samples
    and every worker's batch has b samples. Equal up to float summation order."""
    spec = ModelSpec(gan=gan)
    G, D = build_generator(spec, 1), build_discriminator(spec, 2)
    rng = torch.Generator().manual_seed(5)
    batches = []
    for _ in range(3):
        real = torch.rand(6, 784, generator=rng) * 2 - 1
        real_labels = torch.randint(0, 10, (6,), generator=rng)
        z = torch.randn(6, 100, generator=rng)
        labels = torch.randint(0, 10, (6,), generator=rng) if spec.conditional else None
        batches.append((real, real_labels, z, labels))
    replies = [compute_gradients(spec, G, D, r, rl, G(z, l), l) for r, rl, z, l in batches]
    cat = (lambda i: None if batches[0][i] is None else torch.cat([b[i] for b in batches]))
    union = compute_gradients(spec, G, D, cat(0), cat(1), G(cat(2), cat(3)), cat(3))
    for part in ("discriminator", "generator"):
        mean = average([getattr(r, part) for r in replies])
        for name, g in getattr(union, part).items():
            torch.testing.assert_close(mean[name], g, rtol=1e-5, atol=1e-7, msg=f"{part}.{name}")


def test_simulate_is_deterministic_and_its_traffic_is_the_formula(tmp_path):
    config = _config(model=ModelSpec(gan="acgan"), disc_steps=2)
    runs = [simulate(config, DataConfig("synthetic"), str(tmp_path / f"run{i}"), progress=False, algorithm="psgan")
            for i in range(2)]
    assert runs[0]["generator_sha256"] == runs[1]["generator_sha256"]
    formula = traffic_per_iteration(config, workers=3)
    g, d = 4 * (716_560 + 1_000), 4 * 670_219  # the MLP ACGAN: G (with its class embedding), D
    assert formula["server_to_worker"] == 3 * (g + 2 * d) and formula["worker_to_server"] == 3 * (g + 2 * d)
    for direction in ("server_to_worker", "worker_to_server", "worker_to_worker"):
        assert runs[0]["payload_bytes"][direction] == config.iterations * formula[direction]
    assert runs[0]["workers_alive"] == 3 and runs[0]["stopped_early"] is None


def test_the_server_takes_the_replicas_averaged_buffers():
    """BatchNorm's running statistics change only in the replicas' forward passes: the server
    averages what they send (no model shipped today has buffers; this keeps the path honest)."""
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))

    server, replicas = model(), [model(), model()]
    optimizer = torch.optim.Adam(server.parameters(), foreach=False)
    grads, states = [], []
    for k, replica in enumerate(replicas):
        loss = replica(torch.randn(5, 3, generator=torch.Generator().manual_seed(k))).square().mean()
        grads.append(dict(zip([n for n, _ in replica.named_parameters()],
                              torch.autograd.grad(loss, list(replica.parameters())))))
        states.append({n: b.detach().clone() for n, b in replica.named_buffers()})
    ParameterServer.apply(server, optimizer, grads, states)
    expected = (replicas[0][1].running_mean + replicas[1][1].running_mean) / 2
    torch.testing.assert_close(server[1].running_mean, expected)
    assert int(server[1].num_batches_tracked) == 1


def test_with_a_threshold_the_run_goes_on_when_workers_crash(tmp_path):
    config = _config(iterations=5)
    summary = simulate(config, DataConfig("synthetic"), str(tmp_path), progress=False, algorithm="psgan",
                       options=PSGANOptions(threshold=1), emulation=Emulation(crash_every=2))
    assert summary["iterations"] == 5 and summary["stopped_early"] is None and summary["workers_alive"] == 1
    answered = [json.loads(line)["answered"] for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert answered == [3, 3, 2, 2, 1]


def test_waiting_for_all_stops_the_run_when_a_worker_is_lost(tmp_path):
    config = _config(iterations=5)
    summary = simulate(config, DataConfig("synthetic"), str(tmp_path), progress=False, algorithm="psgan",
                       emulation=Emulation(crash_every=2))
    # the loss shows in iteration 3, which then has 2 gradients of the 3 it needs: no step, and the end
    assert summary["iterations"] == 3 and "2 workers left after iteration 3, fewer than the threshold 3" \
        in summary["stopped_early"]


def test_threshold_out_of_range_is_a_config_error():
    with pytest.raises(ConfigError, match="ps_threshold"):
        PSGANOptions(threshold=4).resolve(3)
    with pytest.raises(ConfigError, match="ps_threshold"):
        PSGANOptions(threshold=0).resolve(3)


class Misbehaving(InProcessReplica):
    """Answers with gradients of the wrong shape."""

    async def round(self, order):
        reply = await super().round(order)
        reply.discriminator = {k: v[..., :1] for k, v in reply.discriminator.items()}
        return reply


def test_a_bad_reply_is_rejected_and_the_step_goes_on_with_the_others():
    config = _config(iterations=2)
    shards = load_all_shards(DataConfig("synthetic", num_shards=3))
    workers = build_in_process_replicas(config, shards)
    workers[2] = Misbehaving(workers[2].side)
    records = []
    result = asyncio.run(PSGANTrainer(config, PSGANOptions(threshold=2), ParameterServer(config, GeneratorSide(config)),
                                             workers, on_iteration=records.append).run())
    assert result.rejections == 2 and result.workers_alive == 3 and result.stopped_early is None
    assert [r.answered for r in records] == [2, 2]


def test_a_round_out_of_protocol_is_refused():
    config = _config(workers=1)
    (shard,) = load_all_shards(DataConfig("synthetic", num_shards=1))
    side = ReplicaSide(config, shard)
    d_state = weights(side.discriminator)
    with pytest.raises(ValueError, match="generator's weights"):
        side.handle(GradientOrder(1, 1, d_state))
    with pytest.raises(ValueError, match="does not match the model"):
        side.handle(GradientOrder(1, 1, {k: v[:1] for k, v in d_state.items()}, weights(side.generator)))
    with pytest.raises(ValueError, match="not finite"):
        side.handle(GradientOrder(1, 1, d_state, {k: v * float("nan") for k, v in weights(side.generator).items()}))
    with pytest.raises(ValueError, match="without its round 1"):
        side.handle(GradientOrder(1, 2, d_state))
    side.handle(GradientOrder(1, 1, d_state, weights(side.generator)))
    with pytest.raises(ValueError, match="rounds before it"):
        side.handle(GradientOrder(1, 3, d_state))  # round 2 skipped


def test_the_old_name_and_flag_still_work_for_a_release_with_one_line_each(tmp_path, caplog, monkeypatch, capsys):
    """The data-parallel GAN is the parameter-server GAN: `--algorithm dpgan`, `--dp-threshold`,
    MDGAN_DP_THRESHOLD, an experiment's or a launch.toml's `dp_threshold` still work, each said once."""
    import logging

    from mdgan import algorithms, renames
    from mdgan_app.cli import main
    from mdgan_app.experiment import expand
    from services.server.__main__ import build_parser as server_parser

    renames._warned.clear()
    caplog.set_level(logging.WARNING, logger="mdgan")
    assert algorithms.get("dpgan") is algorithms.get("psgan")
    args = server_parser().parse_args(["--algorithm", "dpgan", "--dp-threshold", "2"])
    assert (args.algorithm, args.ps_threshold) == ("psgan", 2)
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == ["--algorithm dpgan is deprecated and will be removed in a later release: it is now "
                        "--algorithm psgan (the parameter-server GAN)",
                        "--dp-threshold is deprecated and will be removed in a later release: it is now "
                        "--ps-threshold (the parameter-server GAN)"]
    monkeypatch.setenv("MDGAN_DP_THRESHOLD", "3")
    assert server_parser().parse_args([]).ps_threshold == 3
    monkeypatch.delenv("MDGAN_DP_THRESHOLD")
    (run,) = expand({"runs": [{"algorithm": "dpgan", "dp_threshold": 2, "workers": 3}]})
    assert (run["algorithm"], run["ps_threshold"]) == ("psgan", 2) and "dp_threshold" not in run
    with pytest.raises(ConfigError, match="one setting"):
        expand({"runs": [{"algorithm": "psgan", "dp_threshold": 2, "ps_threshold": 3}]})

    flags = ["--workers", "3", "--iterations", "3", "--dataset", "synthetic", "--eval-every", "-1", "--no-progress"]
    assert main(["simulate", "--algorithm", "dpgan", "--dp-threshold", "2", *flags, "--out", str(tmp_path / "old")]) == 0
    assert main(["simulate", "--algorithm", "psgan", "--ps-threshold", "2", *flags, "--out", str(tmp_path / "new")]) == 0
    old, new = (json.load(open(tmp_path / name / "summary.json")) for name in ("old", "new"))
    assert old["algorithm"] == new["algorithm"] == "psgan"
    assert old["generator_sha256"] == new["generator_sha256"] and old["psgan"] == new["psgan"]
