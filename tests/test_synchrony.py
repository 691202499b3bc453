"""Partial synchronisation (mdgan/algorithms/mdgan/synchrony.py) with handles whose answers the test holds back."""

import asyncio
import copy
from types import SimpleNamespace

import torch

from mdgan.algorithms.mdgan.trainer import SwapReport, Trainer, WorkerHandle
from mdgan.algorithms.base import WorkerLost
from mdgan.config import ModelSpec, TrainingConfig
from mdgan.gan import GeneratorSide
from mdgan.step_results import StepResult
from mdgan.algorithms.mdgan.synchrony import Issued, PartialSync, staleness_weight


class HeldWorker(WorkerHandle):
    """Answers with constant feedback; while `held`, its answer waits for `release`."""

    def __init__(self, index: int, held: bool = False):
        self.worker_id, self.shard_index, self.shard_size = f"worker-{index}", index, 1000
        self.release = asyncio.Event()
        if not held:
            self.release.set()
        self.steps = []

    async def step(self, iteration, batch):
        self.steps.append(iteration)
        await self.release.wait()
        return StepResult(torch.full_like(batch.generated, 0.01 * (self.shard_index + 1)), 0.0, 0.0, 0.5, 0.5)

    async def swap(self, order):
        return SwapReport(order.swap_round, True, True, 0)

    async def cancel_swap(self, swap_round, sender, reason):
        pass

    async def stop(self, reason):
        pass


def _trainer(workers, **sync) -> Trainer:
    config = TrainingConfig(workers=len(workers), iterations=10, swap_every=1000, model=ModelSpec(gan="gan"),
                            **sync).validate()
    return Trainer(config, GeneratorSide(config), workers)


def test_quorum_goes_on_without_the_straggler_and_drops_its_late_answer():
    async def scenario():
        workers = [HeldWorker(0), HeldWorker(1), HeldWorker(2, held=True)]
        trainer = _trainer(workers, sync="quorum", quorum=2)
        first = await trainer.iteration(1)
        assert (first.active_workers, first.answered, first.late) == (3, 2, 0)
        second = await trainer.iteration(2)  # the straggler is still busy: no new batches for it
        assert (second.active_workers, second.answered, second.late) == (2, 2, 0)
        workers[2].release.set()
        await asyncio.sleep(0)
        third = await trainer.iteration(3)  # its answer to iteration 1 is dropped; it gets batches again
        assert (third.active_workers, third.answered, third.late) == (3, 3, 1)
        assert workers[2].steps == [1, 3]
        assert trainer.traffic.payload_bytes["worker_to_server"] == (2 + 2 + 1 + 3) * 10 * 784 * 4
    asyncio.run(scenario())


def test_async_applies_stale_feedback_within_the_bound_and_drops_it_beyond():
    async def scenario(max_staleness):
        workers = [HeldWorker(0), HeldWorker(1, held=True)]
        trainer = _trainer(workers, sync="async", max_staleness=max_staleness)
        first = await trainer.iteration(1)
        assert (first.answered, first.late) == (1, 0)  # one update of G, from the one answer in
        workers[1].release.set()
        await asyncio.sleep(0)
        second = await trainer.iteration(2)
        return second, trainer

    second, trainer = asyncio.run(scenario(1))
    # the stale answer (weight 1/2), then fresh batches for both and both answers
    assert (second.active_workers, second.answered, second.late) == (2, 3, 0)
    second, _ = asyncio.run(scenario(0))
    assert (second.active_workers, second.answered, second.late) == (2, 2, 1)


def test_async_weights_stale_feedback_by_one_over_one_plus_staleness():
    config = TrainingConfig(workers=1, iterations=10, model=ModelSpec(gan="gan"), sync="async").validate()
    gen = GeneratorSide(config)
    old = gen.generate(1)  # batches of iteration 1
    feedback = torch.full_like(old.samples[0], 0.01)
    gen.update(gen.generate(1), [(0, feedback)])  # G moves on: the graph of `old` is stale
    twin = copy.deepcopy(gen)
    sync = PartialSync(config)
    sync._update(SimpleNamespace(generator=gen), 3, [[(Issued(None, 1, old, old.for_worker(0)), feedback)]])
    # by hand: the same noise through the current G, the feedback weighted 1 / (1 + 2)
    twin.optimizer.zero_grad(set_to_none=True)
    samples = twin.generator(old.noise, None).view(1, 10, 784)
    samples.backward(feedback.unsqueeze(0) * (1 / 3))
    twin.optimizer.step()
    for a, b in zip(gen.generator.parameters(), twin.generator.parameters()):
        assert torch.equal(a, b)
    assert staleness_weight(0) == 1 and staleness_weight(3) == 0.25


class DyingWorker(HeldWorker):
    """Its step is out (held) when a swap finds it gone; then the step fails too, as a lost stream's do."""

    async def step(self, iteration, batch):
        self.steps.append(iteration)
        await self.release.wait()
        raise WorkerLost(f"{self.worker_id}: stream closed")

    async def swap(self, order):
        self.release.set()
        raise WorkerLost(f"{self.worker_id}: stream closed")


def test_async_counts_a_worker_lost_in_a_swap_once_though_its_step_was_still_out():
    async def scenario():
        workers = [HeldWorker(0), HeldWorker(1), DyingWorker(2, held=True)]
        config = TrainingConfig(workers=3, iterations=10, swap_every=1, model=ModelSpec(gan="gan"), sync="async",
                                max_staleness=2).validate()
        trainer = Trainer(config, GeneratorSide(config), workers)
        trainer.swap_period = 1
        records = [await trainer.iteration(t) for t in (1, 2, 3)]
        return records, trainer

    records, trainer = asyncio.run(scenario())
    assert records[0].swap_round == 1 and records[0].lost == 1  # lost in the swap after iteration 1
    assert [r.lost for r in records[1:]] == [0, 0]  # its failed step, harvested later, is not a second loss
    assert len(trainer.roster.alive()) == 2
