"""The paper's baselines, on the same models, seeds, data and outputs as MD-GAN.

- Standalone GAN: one G and one D on the whole dataset, the usual loop (as in pytorch/examples
  dcgan): D steps on (real, G(z).detach()), then one G step through D on the same fake batch.
- FL-GAN (federated learning adapted to GANs): every worker holds a G and a D and trains them
  on its shard like a standalone GAN; every ceil(E*m/b) iterations the server averages all G and
  all D (FedAvg, weighted by shard size) and sends the averages back.

Both yield IterationRecords, so history, evaluation and summaries are the same as MD-GAN's.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
from torch import nn

from mdgan.cluster import IterationRecord, RunResult, Traffic
from mdgan.config import TrainingConfig
from mdgan.data import Shard, ShardSampler
from mdgan.mdgan import (DiscriminatorSide, GeneratorSide, derive_seed, discriminator_loss, generator_loss,
                         make_adam)


def _state_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


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
        self.g.updates += 1
        return {"gen_loss": gen_loss.item(), "disc_loss": disc_loss.item(), "real_accuracy": real_acc,
                "fake_accuracy": fake_acc}


def _record(t: int, workers: int, stats: list[dict], started: float, averaged: int | None) -> IterationRecord:
    mean = {k: sum(s[k] for s in stats) / len(stats) for k in stats[0]}
    return IterationRecord(iteration=t, active_workers=workers, answered=workers, rejected=0, lost=0,
                           swap_round=averaged, seconds=time.perf_counter() - started, **mean)


def run_standalone(config: TrainingConfig, generator: GeneratorSide, dataset: Shard,
                   on_iteration: Callable[[IterationRecord], None] | None = None) -> RunResult:
    gan = LocalGAN(config, dataset, generator)
    last = None
    for t in range(1, config.iterations + 1):
        started = time.perf_counter()
        last = _record(t, 1, [gan.step()], started, None)
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


def run_flgan(config: TrainingConfig, server: GeneratorSide, shards: list[Shard],
              on_iteration: Callable[[IterationRecord], None] | None = None,
              on_round: Callable[[dict], None] | None = None) -> RunResult:
    """FL-GAN in one process; `server` holds the averaged G. Local Adam states stay on their
    workers across rounds. The last iteration always ends with an averaging round, so the
    server's G is the federation's final model."""
    init_d = DiscriminatorSide(config, shards[0]).discriminator.state_dict()
    workers = []
    for shard in shards:
        worker = LocalGAN(config, shard, GeneratorSide(config))
        # Each worker draws its own noise: seeded per worker, not the server's stream.
        worker.g._noise = torch.Generator().manual_seed(derive_seed(config.seed, "flgan-noise", shard.index))
        worker.d.discriminator.load_state_dict(init_d)
        workers.append(worker)
    period = config.swap_period(min(len(s) for s in shards))
    weights = [float(len(s)) for s in shards]
    traffic, rounds, last = Traffic(), 0, None
    model_bytes = _state_bytes(server.generator) + _state_bytes(workers[0].d.discriminator)
    for t in range(1, config.iterations + 1):
        started = time.perf_counter()
        stats = [w.step() for w in workers]
        averaged = None
        if t % period == 0 or t == config.iterations:
            rounds += 1
            averaged = rounds
            g_avg = fedavg([w.g.generator.state_dict() for w in workers], weights)
            d_avg = fedavg([w.d.discriminator.state_dict() for w in workers], weights)
            server.generator.load_state_dict(g_avg)
            for w in workers:
                w.g.generator.load_state_dict(g_avg)
                w.d.discriminator.load_state_dict(d_avg)
            # Table III: each worker sends theta + w up and receives theta + w down, per round.
            traffic.payload_bytes["worker_to_server"] += len(workers) * model_bytes
            traffic.payload_bytes["server_to_worker"] += len(workers) * model_bytes
            if on_round:
                on_round({"round": rounds, "iteration": t})
        last = _record(t, len(workers), stats, started, averaged)
        if on_iteration:
            on_iteration(last)
    server.updates = config.iterations
    return RunResult(iterations=config.iterations, workers=len(workers), workers_alive=len(workers),
                     swaps=rounds, rejections=0, swap_period=period, traffic=traffic, last=last)
