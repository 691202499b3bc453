"""The paper's baselines, on the same models, seeds, data and outputs as MD-GAN.

- Standalone GAN: one G and one D on the whole dataset, the usual loop (as in pytorch/examples
  dcgan): D steps on (real, G(z).detach()), then one G step through D on the same fake batch.
- FL-GAN (federated learning adapted to GANs): every worker holds a G and a D and trains them
  on its shard like a standalone GAN; every ceil(E*m/b) iterations the server averages all G and
  all D (FedAvg, weighted by shard size) and sends the averages back.

Both yield IterationRecords, so history, evaluation and summaries are the same as MD-GAN's.
"""

from __future__ import annotations

import abc
import asyncio
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from mdgan.cluster import (RUN_FINISHED, InputRejected, IterationRecord, RunResult, Traffic, WorkerLost,
                           tell_to_stop, with_deadline)
from mdgan.config import TrainingConfig
from mdgan.data import Shard, ShardSampler
from mdgan.mdgan import (DiscriminatorSide, GeneratorSide, derive_seed, discriminator_loss, generator_loss,
                         make_adam)


class LocalGAN:
    """One G and one D trained together on one shard: the standalone GAN, and an FL-GAN worker.

    Built from the same GeneratorSide/DiscriminatorSide as MD-GAN, so that with the whole dataset
    in one shard it starts from MD-GAN's N = 1 weights, noise and real batches.
    """

    def __init__(self, config: TrainingConfig, shard: Shard, generator: GeneratorSide | None = None):
        self.config = config
        self.spec = config.model
        self.g = generator or GeneratorSide(config)
        self.d = DiscriminatorSide(config, shard)

    def step(self) -> dict:
        spec, G, D = self.spec, self.g.generator, self.d.discriminator
        batches = self.g.generate(1)  # the server's noise stream: same z and labels as MD-GAN
        fake, labels = batches.samples[0], None if batches.labels is None else batches.labels[0]  # (b, *shape), (b,)
        real, real_labels = self.d.sampler.next_batch()
        disc_loss, real_acc, fake_acc = torch.tensor(float("nan")), float("nan"), float("nan")
        for _ in range(self.config.disc_steps):
            real_logits, fake_logits = D(real), D(fake.detach())
            disc_loss = discriminator_loss(spec, real_logits, real_labels, fake_logits, labels)
            self.d.optimizer.zero_grad(set_to_none=True)
            disc_loss.backward()
            self.d.optimizer.step()
            real_acc = (real_logits[:, 0] > 0).float().mean().item()
            fake_acc = (fake_logits[:, 0] <= 0).float().mean().item()
        gen_loss = generator_loss(spec, D(fake), labels)
        self.g.optimizer.zero_grad(set_to_none=True)
        gen_loss.backward()  # through D into G; D's gradients are dropped before its next step
        self.g.optimizer.step()
        return {"gen_loss": gen_loss.item(), "disc_loss": disc_loss.item(), "real_accuracy": real_acc,
                "fake_accuracy": fake_acc}


def _record(t: int, workers: int, answered: int, stats: list[dict], seconds: float,
            averaged: int | None) -> IterationRecord:
    mean = {k: sum(s[k] for s in stats) / len(stats) for k in stats[0]}
    return IterationRecord(iteration=t, active_workers=workers, answered=answered, rejected=0, lost=workers - answered,
                           swap_round=averaged, seconds=seconds, **mean)


def run_standalone(config: TrainingConfig, generator: GeneratorSide, dataset: Shard,
                   on_iteration: Callable[[IterationRecord], None] | None = None) -> RunResult:
    gan = LocalGAN(config, dataset, generator)
    last = None
    for t in range(1, config.iterations + 1):
        started = time.perf_counter()
        stats = gan.step()
        last = _record(t, 1, 1, [stats], time.perf_counter() - started, None)
        if on_iteration:
            on_iteration(last)
    return RunResult(iterations=config.iterations, workers=1, workers_alive=1, swaps=0, rejections=0,
                     swap_period=0, traffic=Traffic(), last=last)


def fedavg(states: list[dict[str, torch.Tensor]], weights: list[float]) -> dict[str, torch.Tensor]:
    """The weighted average of state dicts (floating tensors; others are taken from the first).

    Written as s_0 + sum_i (w_i / W) (s_i - s_0): the same average, but exactly the identity when
    every state is the same (no rounding from scaling and summing equal terms).
    """
    total = sum(weights)
    averaged = {}
    for name, first in states[0].items():
        if first.is_floating_point():
            acc = first.clone()
            for state, w in zip(states[1:], weights[1:]):  # fixed order: repeatable
                acc += (state[name] - first) * (w / total)
            averaged[name] = acc
        else:
            averaged[name] = first.clone()
    return averaged


@dataclass
class LocalRoundResult:
    """What an FL-GAN worker returns after its local iterations."""

    generator: dict[str, torch.Tensor]
    discriminator: dict[str, torch.Tensor]
    stats: list[dict]  # one entry per local iteration: gen_loss, disc_loss, real_accuracy, fake_accuracy
    sent_bytes: int  # payload: tensor bytes of both states


class FederatedWorker(abc.ABC):
    """What the FL-GAN loop sees of a worker, wherever it runs."""

    worker_id: str
    shard_index: int
    shard_size: int

    @abc.abstractmethod
    async def local_round(self, round_: int, first_iteration: int, iterations: int,
                          generator: dict[str, torch.Tensor], discriminator: dict[str, torch.Tensor]) -> LocalRoundResult:
        """Load the global G and D, train them `iterations` times on the local shard, return them."""

    @abc.abstractmethod
    async def stop(self, reason: str) -> None:
        """The run is over (or this worker is dropped from it)."""


def make_flgan_worker_gan(config: TrainingConfig, shard: Shard) -> LocalGAN:
    """An FL-GAN worker's G and D: both start from the run's initial weights; its noise is its own."""
    gan = LocalGAN(config, shard, GeneratorSide(config))
    gan.g._noise = torch.Generator().manual_seed(derive_seed(config.seed, "flgan-noise", shard.index))
    return gan


def train_local_round(gan: LocalGAN, generator: dict, discriminator: dict, iterations: int) -> LocalRoundResult:
    """One FL-GAN round on a worker. Local Adam states stay with the worker across rounds."""
    gan.g.generator.load_state_dict(generator)
    gan.d.discriminator.load_state_dict(discriminator)
    stats = [gan.step() for _ in range(iterations)]
    g_state = {k: v.detach().clone() for k, v in gan.g.generator.state_dict().items()}
    d_state = {k: v.detach().clone() for k, v in gan.d.discriminator.state_dict().items()}
    sent = sum(t.numel() * t.element_size() for t in [*g_state.values(), *d_state.values()])
    return LocalRoundResult(g_state, d_state, stats, sent)


class InProcessFederatedWorker(FederatedWorker):
    def __init__(self, config: TrainingConfig, shard: Shard):
        self.gan = make_flgan_worker_gan(config, shard)
        self.worker_id = f"worker-{shard.index}"
        self.shard_index = shard.index
        self.shard_size = len(shard)

    async def local_round(self, round_, first_iteration, iterations, generator, discriminator) -> LocalRoundResult:
        return train_local_round(self.gan, generator, discriminator, iterations)

    async def stop(self, reason: str) -> None:
        return None


class FederatedTrainer:
    """FL-GAN: rounds of ceil(E*m/b) local iterations on every worker, then FedAvg of G and D.

    The last round may be shorter, so that the server's G after I iterations is an average.
    """

    def __init__(self, config: TrainingConfig, server: GeneratorSide, workers: list[FederatedWorker],
                 initial_discriminator: dict[str, torch.Tensor], *, round_timeout: float | None = None,
                 on_iteration: Callable[[IterationRecord], None] | None = None,
                 on_round: Callable[[dict], None] | None = None):
        self.config = config
        self.server = server
        self.workers = sorted(workers, key=lambda w: w.shard_index)
        self.active = list(self.workers)
        self.discriminator = {k: v.detach().clone() for k, v in initial_discriminator.items()}
        self.round_timeout = round_timeout
        self.on_iteration = on_iteration
        self.on_round = on_round
        self.period = config.swap_period(min(w.shard_size for w in self.workers))
        self.traffic = Traffic()
        self.rejections = 0

    async def run(self) -> RunResult:
        done, rounds, last, stopped = 0, 0, None, None
        while done < self.config.iterations:
            if not self.active:
                stopped = f"no workers left after iteration {done}"
                break
            rounds += 1
            count = min(self.period, self.config.iterations - done)
            started = time.perf_counter()
            generator = self.server.generator.state_dict()
            active = list(self.active)
            replies = await asyncio.gather(*(with_deadline(w.local_round(rounds, done + 1, count, generator,
                                                                          self.discriminator), self.round_timeout) for w in active),
                                           return_exceptions=True)
            results, weights = [], []
            down = sum(t.numel() * t.element_size() for t in [*generator.values(), *self.discriminator.values()])
            for worker, reply in zip(active, replies):
                self.traffic.payload_bytes["server_to_worker"] += down
                if isinstance(reply, LocalRoundResult):
                    self.traffic.payload_bytes["worker_to_server"] += reply.sent_bytes
                    results.append(reply)
                    weights.append(float(worker.shard_size))
                elif isinstance(reply, InputRejected):  # this round goes on without it, as in MD-GAN
                    self.rejections += 1
                elif isinstance(reply, (WorkerLost, asyncio.TimeoutError)):
                    self.active.remove(worker)
                    await tell_to_stop(worker, str(reply) or "missed its deadline")
                else:
                    raise reply
            seconds = (time.perf_counter() - started) / count
            for i in range(count):
                if i == count - 1 and results:  # worker-rank order, as everywhere: repeatable
                    # the average becomes the server's G at the round's last iteration, not before: an
                    # evaluation started at an iteration inside the round sees the G of that iteration
                    self.server.generator.load_state_dict(fedavg([r.generator for r in results], weights))
                    self.discriminator = fedavg([r.discriminator for r in results], weights)
                stats = [r.stats[i] for r in results] or [dict.fromkeys(
                    ("gen_loss", "disc_loss", "real_accuracy", "fake_accuracy"), float("nan"))]
                last = _record(done + i + 1, len(active), len(results), stats, seconds,
                               rounds if i == count - 1 else None)
                if self.on_iteration:
                    self.on_iteration(last)
            done += count
            if self.on_round:
                self.on_round({"round": rounds, "iteration": done, "workers": len(results)})
        for worker in list(self.active):
            await tell_to_stop(worker, RUN_FINISHED, 10.0)
        return RunResult(iterations=done, workers=len(self.workers), workers_alive=len(self.active), swaps=rounds,
                         rejections=self.rejections, swap_period=self.period, traffic=self.traffic, last=last, stopped_early=stopped)


def run_flgan(config: TrainingConfig, server: GeneratorSide, shards: list[Shard],
              on_iteration: Callable[[IterationRecord], None] | None = None,
              on_round: Callable[[dict], None] | None = None) -> RunResult:
    """FL-GAN in one process; `server` ends with the federation's averaged G."""
    workers = [InProcessFederatedWorker(config, shard) for shard in shards]
    initial = workers[0].gan.d.discriminator.state_dict()
    trainer = FederatedTrainer(config, server, workers, initial, on_iteration=on_iteration, on_round=on_round)
    return asyncio.run(trainer.run())
