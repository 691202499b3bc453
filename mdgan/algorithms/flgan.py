"""FL-GAN (federated learning adapted to GANs, the paper's baseline): every worker holds a G and a D and
trains them on its shard like a standalone GAN (standalone.py's LocalGAN); every ceil(E*m/b)
iterations the server averages all G and all D (FedAvg, weighted by shard size) and sends the
averages back. Its rounds yield IterationRecords, so history, evaluation and summaries are MD-GAN's.
"""

from __future__ import annotations

import abc
import asyncio
import time
from dataclasses import dataclass
from typing import Callable

import torch

from mdgan import privacy
from mdgan.aggregation import fedavg
from mdgan.algorithms.base import (RUN_FINISHED, Algorithm, InProcessRun, IterationRecord, RunResult, Traffic,
                                   ask_all, last_iteration, tell_to_stop, why_lost)
from mdgan.algorithms.loop_checkpoints import LoopCheckpoints, loop_checkpoints
from mdgan.algorithms.standalone import LocalGAN, iteration_record, site_privacy
from mdgan.algorithms.traffic import discriminator_state_bytes, generator_state_bytes
from mdgan.config import TrainingConfig
from mdgan.data import Shard
from mdgan.gan import GeneratorSide, derive_seed
from mdgan.privacy_ledger import PrivacyLedger, site_ledger


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


def make_flgan_worker_gan(config: TrainingConfig, shard: Shard, ledger: PrivacyLedger | None = None) -> LocalGAN:
    """An FL-GAN worker's G and D: both start from the run's initial weights; its noise is its own (with DP, its
    D's noise from the site's ledger's secret)."""
    gan = LocalGAN(config, shard, GeneratorSide(config, trace_as=f"G{shard.index}"), ledger)
    gan.g._noise = torch.Generator().manual_seed(derive_seed(config.seed, "flgan-noise", shard.index))
    return gan


def train_local_round(gan: LocalGAN, generator: dict, discriminator: dict, iterations: int) -> LocalRoundResult:
    """One FL-GAN round on a worker. Local Adam states stay with the worker across rounds."""
    gan.g.generator.load_state_dict(generator)
    gan.d.discriminator.load_state_dict(discriminator)
    stats = [privacy.released_stats(gan.step(), gan.config.privacy) for _ in range(iterations)]
    g_state = {k: v.detach().clone() for k, v in gan.g.generator.state_dict().items()}
    d_state = {k: v.detach().clone() for k, v in gan.d.discriminator.state_dict().items()}
    sent = sum(t.numel() * t.element_size() for t in [*g_state.values(), *d_state.values()])
    return LocalRoundResult(g_state, d_state, stats, sent)


class InProcessFederatedWorker(FederatedWorker):
    def __init__(self, config: TrainingConfig, shard: Shard, ledger: PrivacyLedger | None = None):
        self.gan = make_flgan_worker_gan(config, shard, ledger)
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
                 on_round: Callable[[dict], None] | None = None, stop_after: int | None = None):
        self.config = config
        self.until = last_iteration(config, stop_after)
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
        self.last_sent: dict[str, dict] = {}  # worker id -> the local D it sent at its last round (mdgan audit)
        self.privacy: dict[str, dict] = {}  # DP: worker id -> the (epsilon, delta) it last reported
        # at_round_end(before, done): after each whole round (the averages installed, its records written), the
        # iterations done before it and now: a boundary a run can be checkpointed at and resumed from
        self.at_round_end: Callable[[int, int], None] | None = None
        self.done = 0  # iterations done: whole rounds, but for a stop inside one (stop_after)
        self.rounds = 0  # rounds averaged

    def state_dict(self) -> dict:
        """The loop's own state at a round's end (the server's G and each worker's pair are their sides')."""
        return {"done": self.done, "rounds": self.rounds, "discriminator": dict(self.discriminator),
                "payload_bytes": dict(self.traffic.payload_bytes), "rejections": self.rejections,
                "last_sent": dict(self.last_sent), "privacy": dict(self.privacy),
                "active": [w.worker_id for w in self.active]}

    def load_state_dict(self, state: dict) -> None:
        self.done, self.rounds = int(state["done"]), int(state["rounds"])
        self.discriminator = dict(state["discriminator"])
        self.traffic.payload_bytes.update(state["payload_bytes"])
        self.rejections = int(state["rejections"])
        self.last_sent, self.privacy = dict(state["last_sent"]), dict(state["privacy"])
        self.active = [w for w in self.workers if w.worker_id in set(state["active"])]

    async def run(self) -> RunResult:
        done, rounds, last, stopped = self.done, self.rounds, None, None
        while done < self.until:
            if not self.active:
                stopped = f"no workers left after iteration {done}"
                break
            rounds += 1
            count = min(self.period, self.config.iterations - done)
            started = time.perf_counter()
            generator = self.server.generator.state_dict()
            active = list(self.active)
            replies = await ask_all(active, lambda w: w.local_round(rounds, done + 1, count, generator,
                                                                   self.discriminator), self.round_timeout)
            down = sum(t.numel() * t.element_size() for t in [*generator.values(), *self.discriminator.values()])
            self.traffic.payload_bytes["server_to_worker"] += down * len(active)
            results = replies.answers
            weights = [float(worker.shard_size) for worker, _ in replies.good]
            for reply in results:
                self.traffic.payload_bytes["worker_to_server"] += reply.sent_bytes
            for worker, reply in replies.good:
                self.last_sent[f"worker-{worker.shard_index}"] = reply.discriminator
                if reply.stats and "epsilon" in reply.stats[-1]:
                    self.privacy[f"worker-{worker.shard_index}"] = site_privacy(reply.stats[-1])
            self.rejections += len(replies.rejected)  # this round goes on without them, as in MD-GAN
            for worker, error in replies.lost:
                self.active.remove(worker)
                await tell_to_stop(worker, why_lost(error))
            seconds = (time.perf_counter() - started) / count
            # stop_after inside this round: only its iterations up to there, with the G each of them had
            recorded = min(count, self.until - done)
            for i in range(recorded):
                if i == count - 1 and results:  # worker-rank order, as everywhere: repeatable
                    # the average becomes the server's G at the round's last iteration, not before: an
                    # evaluation started at an iteration inside the round sees the G of that iteration
                    self.server.generator.load_state_dict(fedavg([r.generator for r in results], weights))
                    self.discriminator = fedavg([r.discriminator for r in results], weights)
                stats = [r.stats[i] for r in results] or [dict.fromkeys(
                    ("gen_loss", "disc_loss", "real_accuracy", "fake_accuracy"), float("nan"))]
                last = iteration_record(done + i + 1, len(active), len(results), stats, seconds,
                               rounds if i == count - 1 else None, dict(self.privacy))
                if self.on_iteration:
                    self.on_iteration(last)
            before, done = done, done + recorded
            if recorded < count:  # stopped before its average: not a round of this run's record
                rounds -= 1
                break
            if self.on_round:
                self.on_round({"round": rounds, "iteration": done, "workers": len(results)})
            self.done, self.rounds = done, rounds
            if self.at_round_end is not None:
                self.at_round_end(before, done)
        for worker in list(self.active):
            await tell_to_stop(worker, RUN_FINISHED, 10.0)
        return RunResult(iterations=done, workers=len(self.workers), workers_alive=len(self.active), swaps=rounds,
                         rejections=self.rejections, swap_period=self.period, traffic=self.traffic, last=last, stopped_early=stopped,
                         privacy=dict(self.privacy) or None)


def run_flgan(config: TrainingConfig, server: GeneratorSide, shards: list[Shard],
              on_iteration: Callable[[IterationRecord], None] | None = None,
              on_round: Callable[[dict], None] | None = None, discriminators: dict | None = None,
              stop_after: int | None = None, sites_root: str | None = None, run_id: str = "",
              checkpoints: LoopCheckpoints | None = None) -> RunResult:
    """FL-GAN in one process; `server` ends with the federation's averaged G (stop_after: with the G the
    whole run holds after that many iterations); with DP each site's ledger in sites_root/worker-K. checkpoints:
    taken at the end of the round a due one falls in (a round is the unit a run resumes from)."""
    workers = [InProcessFederatedWorker(config, shard, site_ledger(config.privacy, shard.index, sites_root, run_id))
               for shard in shards]
    initial = workers[0].gan.d.discriminator.state_dict()
    trainer = FederatedTrainer(config, server, workers, initial, on_iteration=on_iteration, on_round=on_round,
                               stop_after=stop_after)

    def state() -> dict:  # every side's state (G, D, their Adams, noise and sampler) and the loop's
        return {"generator_side": server.state_dict(), "trainer": trainer.state_dict(),
                "sites": {w.worker_id: w.gan.state_dict() for w in workers}}

    if checkpoints is not None:
        resumed = checkpoints.restore()
        if resumed is not None:
            server.load_state_dict(resumed["generator_side"])
            trainer.load_state_dict(resumed["trainer"])
            for worker in workers:
                worker.gan.load_state_dict(resumed["sites"][worker.worker_id])
        trainer.at_round_end = lambda before, done: checkpoints.after(before, done, trainer.until, state)
    result = asyncio.run(trainer.run())
    if discriminators is not None:
        discriminators.update(trainer.last_sent)
    return result


def run_in_process(run: InProcessRun) -> RunResult:
    """FL-GAN in `mdgan simulate`: its rounds are the run's swaps.jsonl lines."""
    return run_flgan(run.config, run.generator, run.shards, on_iteration=run.recorder, on_round=run.recorder.swap,
                     discriminators=run.discriminators, stop_after=run.stop_after, sites_root=run.sites_root(),
                     run_id=run.ledger_run_id(), checkpoints=loop_checkpoints(run, "flgan"))


def per_worker_per_iteration(config: TrainingConfig, shard_size: int, options=None) -> dict[str, float]:
    """|theta_G| + |theta_D| both ways per worker per averaging round, spread over its period S."""
    period, as_dict = config.swap_period(shard_size), config.to_dict()
    model = discriminator_state_bytes(as_dict, config.wire_dtype) + generator_state_bytes(as_dict)
    return {"server_to_worker": model / period, "worker_to_server": model / period, "worker_to_worker": 0}


def run_traffic(summary: dict, history: list[dict], swaps: list[dict]):
    """theta + w down and up per worker per round; nothing between workers."""
    config = summary["config"]
    model = discriminator_state_bytes(config, config.get("wire_dtype", "float32")) + generator_state_bytes(config)
    per_round = sum(s["workers"] for s in swaps)
    formula = {"server_to_worker": per_round * model, "worker_to_server": per_round * model, "worker_to_worker": 0}
    return formula, formula, formula


ALGORITHM = Algorithm(
    name="flgan", title="FL-GAN (federated averaging of G and D)", run_in_process=run_in_process,
    per_worker_per_iteration=per_worker_per_iteration, run_traffic=run_traffic, crashes=False, private=("sgd",),
    resumable=True)
