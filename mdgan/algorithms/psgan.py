"""The synchronous parameter-server GAN, both sides.

Figure 1a of parallel-wgan.txt and the coordinator design of coordinator-architecture.txt: a server
holds G and D and their Adam states; every worker holds replicas of both and a shard. One
iteration is L = --disc-steps synchronous rounds (one round when L = 0):

- round r, server -> worker: D's weights, and G's weights in round 1 (G changes once an iteration);
- worker: loads them; in round 1 it draws its real batch (b samples of its shard) and its noise
  (b vectors, and ACGAN labels, from its own seeded stream) and keeps them for the iteration's
  rounds, as MD-GAN's and the standalone GAN's L discriminator steps do; it computes the gradient
  of D's loss (rounds 1..L) and, in the last round, the gradient of G's loss through D at the
  *same* weights (the coordinator's worker computes both before anything is stepped: the update of
  a round is simultaneous), and sends them;
- server: averages the gradients in rank order (every worker's batch has b samples, so the
  coordinator's weighting by samples is a plain mean, and the mean of per-worker mean-loss
  gradients is the gradient of the mean loss on the union of the batches), sets them as .grad and
  takes an Adam step of D (and of G in the last round).

Models with buffers (BatchNorm's running statistics, in the CNNs) also send the replica's buffers
after its forward passes; the server averages them (floating ones; integer ones from the first
worker), as FedAvg does, since the server itself runs no forward pass. The MLPs have none.

The threshold (--ps-threshold Q, default: all the workers). The coordinator steps as soon as Q
work units are in and cancels the rest. Taking "the first Q to arrive" makes the result depend on
arrival order, and this project's transports end bit for bit where the in-process run ends; so
here the server waits for every live worker up to the step deadline (a lost or late worker leaves
the run) and steps with all the gradients that came, in rank order, when there are at least Q;
a round with fewer makes no step, and the run stops early once fewer than Q workers are left.
Q = K is the fully synchronous server (one loss stops the run); Q < K tolerates K - Q losses.

Traffic per worker per iteration (this algorithm's "Table III"; ``traffic_per_iteration``), with
|theta_G|, |theta_D| parameters, beta_G, beta_D buffer bytes (0 for the MLPs), R = max(L, 1) rounds:
    server -> worker:  4 |theta_G| + beta_G  +  R (4 |theta_D| + beta_D)
    worker -> server:  4 |theta_G| + beta_G  +  4 L |theta_D|  +  R beta_D
    worker -> worker:  0
MNIST MLP ACGAN (|theta_G| = 717,560 with the class embedding, |theta_D| = 670,219), L = 1:
5,551,116 B each way, about 177 times MD-GAN's 31,360 B of feedback.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from mdgan import devices
from mdgan.aggregation import fedavg
from mdgan.algorithms.base import (Algorithm, InProcessRun, InputRejected, IterationRecord, RunResult, crashing, mean,
                                   option)
from mdgan.algorithms.fixed_set import FixedSetTrainer
from mdgan.algorithms.inprocess import InProcessRounds
from mdgan.algorithms.traffic import rounds_run_traffic
from mdgan.config import ConfigError, ModelSpec, TrainingConfig, named
from mdgan.data import Shard, ShardSampler
from mdgan.gan import GeneratorSide, derive_seed, discriminator_loss, generator_loss, make_adam
from mdgan.models import build_discriminator, build_generator
from mdgan.step_results import read_scalars

log = logging.getLogger(__name__)

Named = dict[str, torch.Tensor]


@dataclass(frozen=True)
class PSGANOptions:
    """The parameter-server GAN's own options (each field's metadata names its flag, as in pwgan.py)."""

    # Q: gradients a step needs; None: every worker of the run
    threshold: int | None = option(None, "--ps-threshold", "gradients a step needs (default: every worker; fewer "
                                                           "tolerates losses)", short="Q", type=int)

    def resolve(self, workers: int) -> int:
        q = workers if self.threshold is None else self.threshold
        if not 1 <= q <= workers:
            raise ConfigError(f"{named('ps_threshold')} must be in [1, workers={workers}], got {q}")
        return q

    def check(self, config: TrainingConfig) -> "PSGANOptions":
        """These options, and the run's, checked for the parameter-server GAN (before anything runs)."""
        for flag, value, default in (("--wire-dtype", config.wire_dtype, "float32"), ("--sync", config.sync, "all"),
                                     ("--aggregation", config.aggregation, "mean")):
            if value != default:
                raise ConfigError(f"{flag} {value} is MD-GAN's; the parameter-server GAN sends float32 weights and "
                                  f"gradients and averages every gradient ({flag} {default})")
        self.resolve(config.workers)
        return self

    def summary(self, config: TrainingConfig) -> dict:
        """What summary.json records of them: Q as the run used it."""
        return {"threshold": self.resolve(config.workers)}


def rounds_per_iteration(config: TrainingConfig) -> int:
    return max(config.disc_steps, 1)


# ---------------------------------------------------------------------------------------------
# pure helpers

def weights(module: nn.Module) -> Named:
    """The module's state (parameters and buffers) as named detached copies."""
    return {name: t.detach().clone() for name, t in module.state_dict().items()}


def buffers(module: nn.Module) -> Named:
    return {name: t.detach().clone() for name, t in module.named_buffers()}


def gradients(module: nn.Module, loss: torch.Tensor, retain_graph: bool = False) -> Named:
    """d loss / d parameters, by parameter name (a parameter the loss does not reach gets zeros)."""
    named = list(module.named_parameters())
    grads = torch.autograd.grad(loss, [p for _, p in named], retain_graph=retain_graph, allow_unused=True)
    return {name: torch.zeros_like(p) if g is None else g.detach() for (name, p), g in zip(named, grads)}


def average(named: list[Named]) -> Named:
    """The mean of named tensors, summed in the order given (rank order): repeatable. One entry
    comes back unchanged, bit for bit."""
    if not named:
        raise ValueError("nothing to average")
    out = {}
    for name, first in named[0].items():
        acc = first.clone()
        for other in named[1:]:
            acc += other[name]
        out[name] = acc / len(named) if len(named) > 1 else acc
    return out


def _nbytes(named: Named | None) -> int:
    return 0 if not named else sum(t.numel() * t.element_size() for t in named.values())


# ---------------------------------------------------------------------------------------------
# messages

@dataclass(frozen=True)
class GradientOrder:
    """Server -> worker, once per round."""

    iteration: int
    round: int  # 1..R
    discriminator: Named  # D's state
    generator: Named | None = None  # G's state, round 1 only
    want_discriminator: bool = True  # rounds 1..L
    want_generator: bool = False  # the last round


@dataclass
class GradientReply:
    """Worker -> server, once per round."""

    discriminator: Named | None  # D's gradients (when asked)
    generator: Named | None  # G's gradients (when asked)
    discriminator_buffers: Named  # D's buffers after the forward passes ({} for the MLPs)
    generator_buffers: Named  # G's buffers, last round only ({} otherwise, and for the MLPs)
    disc_loss: float
    gen_loss: float  # nan unless asked
    real_accuracy: float
    fake_accuracy: float


# ---------------------------------------------------------------------------------------------
# worker side

class ReplicaSide:
    """A worker: replicas of G and D, its shard, its own noise."""

    def __init__(self, config: TrainingConfig, shard: Shard):
        self.config = config
        self.spec = config.model
        self.device = devices.resolve(config.device)
        self.generator = build_generator(self.spec, derive_seed(config.seed, "generator-init")).to(self.device)
        self.discriminator = build_discriminator(self.spec, derive_seed(config.seed, "discriminator-init")).to(self.device)
        if self.device.type != "cpu":
            shard = dataclasses.replace(shard, images=shard.images.to(self.device), labels=shard.labels.to(self.device))
        self.sampler = ShardSampler(shard, config.batch_size, derive_seed(config.seed, "worker-sampling", shard.index))
        # (labelled with the algorithm's former name: the same draws as before the rename, the same runs)
        self._noise = torch.Generator().manual_seed(derive_seed(config.seed, "dpgan-noise", shard.index))
        self._iteration: int | None = None
        self._round = 0
        self._batch: tuple | None = None

    @property
    def shard_index(self) -> int:
        return self.sampler.shard.index

    def draw_noise(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        b, spec = self.config.batch_size, self.spec
        z = torch.randn(b, spec.latent_dim, generator=self._noise)  # (b, l), drawn on the CPU
        labels = torch.randint(0, spec.num_classes, (b,), generator=self._noise) if spec.conditional else None
        return z.to(self.device), None if labels is None else labels.to(self.device)

    def handle(self, order: GradientOrder) -> GradientReply:
        """One round. Raises ValueError on an order that does not follow the protocol."""
        check_state(self.discriminator, order.discriminator, "discriminator")
        if order.round == 1:
            if order.generator is None:
                raise ValueError("round 1 must carry the generator's weights")
            check_state(self.generator, order.generator, "generator")
            self.generator.load_state_dict(order.generator)
            self._iteration = order.iteration
            real, real_labels = self.sampler.next_batch()  # (b, *shape), (b,)
            z, fake_labels = self.draw_noise()
            # G is the same in every round of the iteration: one forward, its graph kept for the last round
            self._batch = (real, real_labels, self.generator(z, fake_labels), fake_labels)
        elif order.iteration != self._iteration or order.generator is not None or order.round != self._round + 1:
            raise ValueError(f"round {order.round} of iteration {order.iteration} without its round 1 "
                             f"and the rounds before it")
        self._round = order.round
        self.discriminator.load_state_dict(order.discriminator)
        return compute_gradients(self.spec, self.generator, self.discriminator, *self._batch,
                                 order.want_discriminator, order.want_generator)


def check_state(module: nn.Module, state: Named | None, what: str) -> None:
    """Raises ValueError unless `state` names exactly the module's tensors, with their shapes and
    dtypes, and holds finite numbers."""
    expected = {n: (tuple(t.shape), t.dtype) for n, t in module.state_dict().items()}
    got = {} if state is None else {n: (tuple(t.shape), t.dtype) for n, t in state.items()}
    if got != expected:
        raise ValueError(f"the {what}'s state does not match the model ({len(got)} tensors, {len(expected)} expected)")
    if not all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point()):
        raise ValueError(f"the {what}'s state is not finite")


def compute_gradients(spec: ModelSpec, generator: nn.Module, discriminator: nn.Module, real: torch.Tensor,
                      real_labels: torch.Tensor, fake: torch.Tensor, fake_labels: torch.Tensor | None,
                      want_discriminator: bool = True, want_generator: bool = True) -> GradientReply:
    """One replica's gradients of D's and G's losses on one batch, at the same weights.

    fake = G(z, fake_labels) with its graph: (b, *shape)."""
    real_logits, fake_logits = discriminator(real), discriminator(fake.detach())
    disc_loss = discriminator_loss(spec, real_logits, real_labels, fake_logits, fake_labels)
    d_grads = gradients(discriminator, disc_loss) if want_discriminator else None
    g_grads, gen_loss = None, None
    if want_generator:
        gen_loss = generator_loss(spec, discriminator(fake), fake_labels)
        g_grads = gradients(generator, gen_loss)
    stats = read_scalars(disc_loss, disc_loss if gen_loss is None else gen_loss,  # (one host read a reply)
                         (real_logits[:, 0] > 0).float().mean(), (fake_logits[:, 0] <= 0).float().mean())
    return GradientReply(d_grads, g_grads, buffers(discriminator), buffers(generator) if want_generator else {},
                         stats[0], stats[1] if want_generator else float("nan"), stats[2], stats[3])


# ---------------------------------------------------------------------------------------------
# server side

class ParameterServer:
    """G (the run's GeneratorSide, so outputs and evaluation are MD-GAN's) and D, with their Adams."""

    def __init__(self, config: TrainingConfig, generator: GeneratorSide):
        self.config = config
        self.generator_side = generator
        self.discriminator = build_discriminator(config.model, derive_seed(config.seed, "discriminator-init")).to(
            generator.device)
        self.d_optimizer = make_adam(self.discriminator, config.discriminator_optimizer)

    @property
    def generator(self) -> nn.Module:
        return self.generator_side.generator

    @staticmethod
    def apply(module: nn.Module, optimizer: torch.optim.Optimizer, grads: list[Named],
              buffer_states: list[Named]) -> None:
        """Average the workers' gradients (rank order), one Adam step; the averaged buffers.

        Averaged where the parameters are, whichever transport brought the gradients (a division on CUDA rounds
        unlike one on the CPU): over gRPC they arrive on the CPU, in one process on the workers' device."""
        where = {name: p.device for name, p in module.named_parameters()}
        mean = average([{name: g.to(where[name]) for name, g in named.items()} for named in grads])
        for name, p in module.named_parameters():
            p.grad = mean[name].to(dtype=p.dtype)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if buffer_states and buffer_states[0]:
            averaged = fedavg(buffer_states, [1.0] * len(buffer_states))
            with torch.no_grad():
                for name, b in module.named_buffers():
                    b.copy_(averaged[name])


def check_reply(reply: GradientReply, order: GradientOrder, server: ParameterServer) -> None:
    """Raises InputRejected when a reply does not fit the order it answers."""
    def same_layout(named: Named | None, module: nn.Module, what: str) -> None:
        expected = {n: (tuple(p.shape), p.dtype) for n, p in module.named_parameters()}
        got = {} if named is None else {n: (tuple(t.shape), t.dtype) for n, t in named.items()}
        if got != expected:
            raise InputRejected("bad_gradients", f"{what} gradients do not match the model's parameters")
        if not all(torch.isfinite(t).all() for t in named.values()):
            raise InputRejected("bad_gradients", f"{what} gradients are not finite")

    if order.want_discriminator:
        same_layout(reply.discriminator, server.discriminator, "discriminator")
    if order.want_generator:
        same_layout(reply.generator, server.generator, "generator")


# ---------------------------------------------------------------------------------------------
# the training loop over abstract handles

class ReplicaHandle(abc.ABC):
    """What the parameter-server loop sees of a worker, wherever it runs."""

    worker_id: str
    shard_index: int
    shard_size: int

    @abc.abstractmethod
    async def round(self, order: GradientOrder) -> GradientReply:
        """Send weights, get gradients back. Raises WorkerLost or InputRejected."""

    @abc.abstractmethod
    async def stop(self, reason: str) -> None:
        """The run is over (or this worker is dropped from it)."""


class InProcessReplica(InProcessRounds, ReplicaHandle):
    """ReplicaSide in this process (mdgan/algorithms/inprocess.py)."""


class PSGANTrainer(FixedSetTrainer):
    """Runs I iterations of the parameter server against replica handles (mdgan/algorithms/fixed_set.py:
    a lost worker leaves for good; the run goes on while at least Q are left)."""

    def __init__(self, config: TrainingConfig, options: PSGANOptions, server: ParameterServer,
                 workers: list[ReplicaHandle], *, step_timeout: float | None = None,
                 on_iteration: Callable[[IterationRecord], None] | None = None, stop_after: int | None = None):
        super().__init__(config, workers, step_timeout=step_timeout, on_iteration=on_iteration, stop_after=stop_after)
        self.server = server
        self.threshold = options.resolve(len(self.workers))
        self.skipped_steps = 0  # rounds with fewer than Q gradients

    def too_few_left(self, t: int) -> str | None:
        if len(self.active) >= self.threshold:
            return None
        return f"{len(self.active)} workers left after iteration {t - 1}, fewer than the threshold {self.threshold}"

    async def iteration(self, t: int) -> IterationRecord:
        started = time.perf_counter()
        config, server = self.config, self.server
        rounds = rounds_per_iteration(config)
        participants, rejected, lost = list(self.active), 0, 0
        active_at_start = len(participants)
        generator_state = weights(server.generator)
        stats: list[GradientReply] = []
        wait = update = 0.0
        for r in range(1, rounds + 1):
            order = GradientOrder(t, r, weights(server.discriminator), generator_state if r == 1 else None,
                                  want_discriminator=r <= config.disc_steps, want_generator=r == rounds)
            asked = time.perf_counter()
            replies = await self.ask(t, r, participants, order, lambda reply: check_reply(reply, order, server))
            answered_at = time.perf_counter()
            wait += answered_at - asked
            rejected, lost = rejected + len(replies.rejected), lost + len(replies.lost)
            self.traffic.payload_bytes["server_to_worker"] += len(participants) * (
                _nbytes(order.discriminator) + _nbytes(order.generator))
            good, answered = replies.answers, [worker for worker, _ in replies.good]
            for reply in good:
                self.traffic.payload_bytes["worker_to_server"] += (
                    _nbytes(reply.discriminator) + _nbytes(reply.generator)
                    + _nbytes(reply.discriminator_buffers) + _nbytes(reply.generator_buffers))
            participants = answered
            if len(good) < self.threshold:
                self.skipped_steps += 1
                log.warning("iteration %d round %d: %d gradients, fewer than the threshold %d: no step",
                            t, r, len(good), self.threshold)
                if r == rounds:
                    stats = good
                continue
            if order.want_discriminator:
                server.apply(server.discriminator, server.d_optimizer, [g.discriminator for g in good],
                             [g.discriminator_buffers for g in good])
            if order.want_generator:
                server.apply(server.generator, server.generator_side.optimizer, [g.generator for g in good],
                             [g.generator_buffers for g in good])
                stats = good
            update += time.perf_counter() - answered_at
        self.rejections += rejected
        return IterationRecord(
            iteration=t, active_workers=active_at_start, answered=len(stats), rejected=rejected, lost=lost,
            gen_loss=mean([s.gen_loss for s in stats]), disc_loss=mean([s.disc_loss for s in stats]),
            real_accuracy=mean([s.real_accuracy for s in stats]), fake_accuracy=mean([s.fake_accuracy for s in stats]),
            swap_round=None, seconds=time.perf_counter() - started, wait_seconds=wait, update_seconds=update)


def _state_bytes(module: nn.Module) -> tuple[int, int]:
    """(parameter bytes, buffer bytes)."""
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    bufs = sum(b.numel() * b.element_size() for b in module.buffers())
    return params, bufs


def traffic_per_iteration(config: TrainingConfig, workers: int) -> dict[str, int]:
    """This algorithm's Table III: payload bytes of one iteration with `workers` workers answering.

    Per worker, with theta_G, theta_D parameter bytes, beta_G, beta_D buffer bytes, R = max(L, 1):
      down  theta_G + beta_G + R (theta_D + beta_D)
      up    theta_G + beta_G + L theta_D + R beta_D
    """
    g_params, g_bufs = _state_bytes(build_generator(config.model, 0))
    d_params, d_bufs = _state_bytes(build_discriminator(config.model, 0))
    rounds, steps = rounds_per_iteration(config), config.disc_steps
    down = g_params + g_bufs + rounds * (d_params + d_bufs)
    up = g_params + g_bufs + steps * d_params + rounds * d_bufs
    return {"server_to_worker": workers * down, "worker_to_server": workers * up, "worker_to_worker": 0,
            "label_bytes": 0}


def build_in_process_replicas(config: TrainingConfig, shards: list[Shard]) -> list[InProcessReplica]:
    return [InProcessReplica(ReplicaSide(config, shard)) for shard in shards]


def run_in_process(run: InProcessRun) -> RunResult:
    """The parameter-server GAN in one process (`mdgan simulate`); run.generator is the server's G. A worker
    fails every run.emulation.crash_every iterations."""
    workers = build_in_process_replicas(run.config, run.shards)
    after = crashing(run.recorder, run.emulation.crash_every, lambda: [w for w in workers if not w.crashed])
    trainer = PSGANTrainer(run.config, (run.options or PSGANOptions()).check(run.config),
                                  ParameterServer(run.config, run.generator), workers, on_iteration=after,
                                  stop_after=run.stop_after)
    return asyncio.run(trainer.run())


def per_worker_per_iteration(config: TrainingConfig, shard_size: int, options=None) -> dict[str, float]:
    formula = traffic_per_iteration(config, 1)
    return {k: formula[k] for k in ("server_to_worker", "worker_to_server", "worker_to_worker")}


def _per_iteration_of_run(summary: dict, workers: int) -> dict[str, int]:
    return traffic_per_iteration(TrainingConfig.from_dict(summary["config"]), workers)


ALGORITHM = Algorithm(
    name="psgan", title="the parameter-server GAN", run_in_process=run_in_process,
    per_worker_per_iteration=per_worker_per_iteration, run_traffic=rounds_run_traffic(_per_iteration_of_run),
    options=PSGANOptions)
