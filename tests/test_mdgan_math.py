"""The MD-GAN math against plain autograd, the batch assignment and the swap plan."""

import asyncio
import copy

import pytest
import torch

from mdgan.algorithms.mdgan.trainer import Trainer, TrainerHooks
from mdgan.algorithms.mdgan.inprocess import build_in_process_workers
from mdgan.config import DataConfig, ModelSpec, TrainingConfig
from mdgan.data import load_all_shards
from mdgan.gan import DiscriminatorSide, GeneratorSide, assignment, derangement, generator_loss


def _sides(config):
    shards = load_all_shards(DataConfig("synthetic", num_shards=config.workers))
    return GeneratorSide(config), [DiscriminatorSide(config, s) for s in shards]


@pytest.mark.parametrize("workers,kappa,gan,loss", [
    (1, 1, "acgan", "non-saturating"),
    (3, 2, "acgan", "non-saturating"),
    (4, 2, "gan", "saturating"),
    (5, 3, "acgan", "saturating"),
])
def test_generator_gradient_from_feedback_equals_autograd_through_d_of_g(workers, kappa, gan, loss):
    config = TrainingConfig(workers=workers, kappa=kappa, batch_size=8, disc_steps=2, seed=11,
                            model=ModelSpec(gan=gan, loss=loss)).validate()
    server, sides = _sides(config)
    reference = GeneratorSide(config)  # same seed: same weights and the same noise

    batches = server.generate(kappa)
    feedback = []
    for rank, side in enumerate(sides):
        batch = batches.for_worker(rank)
        feedback.append((batch.generated_index, side.step(batch).feedback))  # D_n trains L steps first
    server.accumulate(batches, feedback)

    # Plain autograd: (1/N) sum_n J_gen(D_n(G(z_g(n)))) with each worker's freshly trained D_n.
    ref_batches = reference.generate(kappa)
    total = 0
    for rank, side in enumerate(sides):
        g, _ = assignment(rank, kappa)
        labels = None if ref_batches.labels is None else ref_batches.labels[g]
        total = total + generator_loss(config.model, side.discriminator(ref_batches.samples[g]), labels)
    (total / workers).backward()

    for (name, p), q in zip(server.generator.named_parameters(), reference.generator.parameters()):
        assert p.grad is not None and q.grad is not None, name
        assert p.grad.abs().max() > 0, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_feedback_is_one_gradient_per_generated_sample():
    config = TrainingConfig(workers=2, kappa=2, batch_size=6).validate()
    server, sides = _sides(config)
    batch = server.generate(2).for_worker(0)
    result = sides[0].step(batch)
    assert result.feedback.shape == (6, 784) and result.feedback.dtype == torch.float32
    assert torch.isfinite(result.feedback).all()


def test_discriminator_steps_move_only_the_discriminator():
    config = TrainingConfig(workers=1, batch_size=4, disc_steps=3).validate()
    server, (side,) = _sides(config)
    g_before = copy.deepcopy(server.generator.state_dict())
    d_before = copy.deepcopy(side.discriminator.state_dict())
    side.step(server.generate(1).for_worker(0))
    assert all(torch.equal(v, server.generator.state_dict()[k]) for k, v in g_before.items())
    assert not all(torch.equal(v, side.discriminator.state_dict()[k]) for k, v in d_before.items())


@pytest.mark.parametrize("kappa,workers", [(1, 1), (1, 4), (2, 3), (3, 10)])
def test_assignment_follows_the_paper(kappa, workers):
    for n in range(workers):
        g, d = assignment(n, kappa)
        assert g == n % kappa and d == (n + 1) % kappa
        if kappa > 1:
            assert g != d  # two distinct batches whenever there are two


@pytest.mark.parametrize("n", [2, 3, 4, 7, 10, 25])
def test_derangement_every_worker_sends_one_and_receives_one_from_another(n):
    ids = [f"worker-{i}" for i in range(n)]
    for swap_round in range(1, 30):
        plan = derangement(ids, seed=5, swap_round=swap_round)
        assert sorted(plan) == sorted(ids)  # every worker sends exactly one
        assert sorted(plan.values()) == sorted(ids)  # and receives exactly one
        assert all(src != dst for src, dst in plan.items())  # from another worker
        assert plan == derangement(ids, seed=5, swap_round=swap_round)  # seeded


def test_derangement_varies_across_rounds_and_is_empty_for_one_worker():
    ids = [f"w{i}" for i in range(6)]
    assert len({tuple(derangement(ids, 0, r).items()) for r in range(1, 20)}) > 5
    assert derangement(["only"], 0, 1) == {}


def _run_in_process(config, shards=None):
    shards = shards or load_all_shards(DataConfig("synthetic", num_shards=config.workers))
    generator = GeneratorSide(config)
    workers = build_in_process_workers(config, shards)
    swaps = []
    result = asyncio.run(Trainer(config, generator, workers, hooks=TrainerHooks(on_swap=swaps.append)).run())
    return generator, workers, result, swaps


def test_each_swap_round_moves_n_discriminators_of_theta_floats():
    config = TrainingConfig(workers=4, iterations=6, swap_every=3, batch_size=5, seed=2).validate()
    _, workers, result, swaps = _run_in_process(config)
    assert result.swaps == 2 and [s["iteration"] for s in swaps] == [3, 6]
    for record in swaps:
        assert all(r["sent"] and r["received"] for r in record["workers"].values())
    theta = sum(p.numel() for p in workers[0].side.discriminator.parameters())
    assert theta == 670_219
    assert result.traffic.payload_bytes["worker_to_worker"] == 2 * 4 * theta * 4  # rounds * N * |theta| * fp32


def test_swapped_discriminator_is_bitwise_the_senders():
    config = TrainingConfig(workers=3, iterations=1, swap_every=1, batch_size=5, seed=9).validate()
    shards = load_all_shards(DataConfig("synthetic", num_shards=3))
    # the same run without the swap gives each worker's D just before the swap
    no_swap = TrainingConfig(**{**config.__dict__, "swap_every": 1000})
    _, trained, _, _ = _run_in_process(no_swap, shards)
    _, swapped, _, swaps = _run_in_process(config, shards)
    before = {w.worker_id: w.side.discriminator.state_dict() for w in trained}
    after = {w.worker_id: w.side.discriminator.state_dict() for w in swapped}
    for sender, receiver in swaps[0]["plan"].items():
        for name, tensor in before[sender].items():
            assert torch.equal(after[receiver][name], tensor), (sender, receiver, name)


def test_swap_resets_or_carries_adam_state():
    for carry in (False, True):
        config = TrainingConfig(workers=2, iterations=2, swap_every=2, batch_size=5,
                                swap_optimizer_state=carry).validate()
        _, workers, result, _ = _run_in_process(config)
        side = workers[0].side
        theta = sum(p.numel() for p in side.discriminator.parameters())
        per_worker = theta * 4 * (3 if carry else 1) + (len(list(side.discriminator.parameters())) * 4 if carry else 0)
        assert result.traffic.payload_bytes["worker_to_worker"] == 2 * per_worker
        assert (len(side.optimizer.state) > 0) == carry


def test_a_crashed_worker_leaves_and_the_generator_averages_over_those_that_answer():
    config = TrainingConfig(workers=3, iterations=6, batch_size=5, swap_every=2).validate()
    shards = load_all_shards(DataConfig("synthetic", num_shards=3))
    generator = GeneratorSide(config)
    workers = build_in_process_workers(config, shards)
    records = []

    def on_iteration(record):
        records.append(record)
        if record.iteration == 2:
            workers[1].crash()

    result = asyncio.run(Trainer(config, generator, workers, hooks=TrainerHooks(on_iteration=on_iteration)).run())
    assert result.iterations == 6 and result.workers_alive == 2
    assert [r.active_workers for r in records] == [3, 3, 3, 2, 2, 2]
    assert [r.answered for r in records] == [3, 3, 2, 2, 2, 2]
    assert records[2].lost == 1


def test_a_worker_lost_during_a_swap_does_not_leave_its_receiver_waiting():
    from mdgan.algorithms.mdgan.inprocess import InProcessWorker
    from mdgan.algorithms.base import WorkerLost

    class DiesInSwap(InProcessWorker):
        async def swap(self, order):
            self.crash()
            raise WorkerLost(f"{self.worker_id} died mid-swap")

    config = TrainingConfig(workers=3, iterations=4, swap_every=2, batch_size=5).validate()
    shards = load_all_shards(DataConfig("synthetic", num_shards=3))
    workers = build_in_process_workers(config, shards)
    workers[1] = DiesInSwap(workers[1].side, workers[0].board, swap_timeout=600)
    for w in workers:
        w.swap_timeout = 600  # without the cancel, the receiver would wait this long
    records, swaps = [], []

    async def run():
        trainer = Trainer(config, GeneratorSide(config), workers,
                          hooks=TrainerHooks(on_iteration=records.append, on_swap=swaps.append))
        return await asyncio.wait_for(trainer.run(), 60)

    result = asyncio.run(run())
    assert result.iterations == 4 and result.workers_alive == 2
    assert [r.lost for r in records] == [0, 1, 0, 0]  # counted in the iteration whose swap lost it
    first = swaps[0]["workers"]
    receiver = swaps[0]["plan"]["worker-1"]
    assert first["worker-1"]["sent"] is False
    assert first[receiver]["received"] is False and "worker-1" in first[receiver]["error"]
    assert all(w["sent"] and w["received"] for w in swaps[1]["workers"].values())  # the next round, among two
