"""The parallel Wasserstein GAN (parallel-wgan.txt, Algorithms 1 and 2, eqs. 6-14), both sides.

A master holds the generator G; K workers each hold a critic D_k and a shard R_k. The objective is
eq. 6, L = (1/K) sum_k W_c(mu_g, mu_rk): the mean over workers of the optimal-transport cost
between the generated batch and the worker's real batch, the cost being parametrised by D_k.

One iteration (what the paper leaves open is decided here, and said so):

1. The master draws n_g = b noise vectors (and ACGAN labels), generates X_g = G(z) and broadcasts
   X_g with the potentials phi = 0 (round 1).
2. Worker k samples n_r = b reals x_i and evaluates once (Algorithm 2) the cost matrix
   c_ij = |D_k(x_i) - D_k(x^g_j)|, D_k(.) being column 0 of the critic's output.
   *Why |.|*: eq. 14 has the norm, Algorithm 2 the plain difference. With the difference,
   c_ij - phi_j = D_k(x_i) - (D_k(x^g_j) + phi_j) and the argmin over j does not depend on i: every
   real sample falls in the same Voronoi cell, whatever the potentials, and the transport problem
   degenerates. With |.| the cost is the distance between critic values, a metric on the critic's
   line; the cells are intervals of it, and sup over 1-Lipschitz D of the transport cost is W1
   (the critic D = a Kantorovich potential attains it), i.e. the usual WGAN quantity.
3. T rounds (the paper's experiments: T = 5). In round t the master sends phi; worker k assigns each
   real sample to its cell sigma(i) = argmin_j c_ij - phi_j (eq. 10; ties to the lowest j) and
   returns the counts N_j^k. The potential step (eq. 9, stochastic ascent of the concave dual F)
   is phi_j^k = phi_j + eta (1/n_g - N_j^k / n_r); the master averages phi^k and the masses
   p_j = (1/K) sum_k N_j^k / n_r (eq. 13, normalised). Algorithm 2's box writes
   phi_j^k = phi_j - eta N_j^k: the same cells (it differs by a shift common to every j, which the
   argmin ignores, and by eta's scale n_r); eq. 9's form keeps sum_j phi_j = 0 and makes eta
   independent of n_r. phi_j^k is a function of phi and N^k, which the master has, so a worker
   sends only N^k (n_g int32) and the master computes phi^k itself (``potential_step``): the same
   numbers as the paper's message, at half its size.
4. After round T, worker k holds the plan pi^k: pi_ij = the share of the T rounds in which real i
   was in cell j (rows sum to 1; sum_i pi_ij = the mean over rounds of N_j^k), and the transport
   cost under it,
       W_k = (1/n_r) sum_ij pi_ij |D_k(x_i) - D_k(x^g_j)|.
   *Why the plan averaged over the rounds, not the round-T cells alone*: the stochastic
   semi-discrete solver the paper follows (Genevay et al. 2016) averages its iterates rather than
   trusting the last one (there the potentials; here the cells, which is what the losses use),
   and round T alone is all-or-nothing whenever the critic ranks the reals above the fakes (then
   c_ij - phi_j = D(x_i) - (D(x^g_j) + phi_j) for every pair and, as with the signed cost, every
   real sample shares one cell). Measured on MNIST (bench/pwgan_masses.py: MLP ACGAN, 2 workers,
   b = 10, T = 5, eta = 1, iterations 51-150 of one run): under round T's counts 44% of the
   generated points had no mass and the largest mass was 0.40 on average (uniform: 0.1); under
   the averaged plan, 3% and 0.22 (eta = 3: 62% and 0.52 against 0% and 0.18). A
   generated point without mass gets no gradient, so the plan decides how much of the batch G
   learns from.
   *Critic loss*: D_k maximises W_k (a WGAN critic maximises its estimate of the distance) under a
   gradient penalty lambda E[(||grad D_k(x_hat)|| - 1)^2] (WGAN-GP, the paper's baseline) on
   x_hat = e x_i + (1 - e) x^g_j, e ~ U[0, 1], j drawn from pi_i: points between *coupled* pairs,
   where WGAN-GP only has random pairs as "a proxy to the optimal coupling". That is how N^k
   enters D_k's loss: generated point j weighs (1/n_r) sum_i pi_ij, its counts averaged over the
   rounds, in W_k (when the reals score above the fakes, W_k = mean_i D_k(x_i) - sum_j m_j
   D_k(x^g_j) with those masses m_j: WGAN's critic loss with mass-weighted fakes). L =
   --disc-steps Adam steps on the fixed coupling. ACGAN adds the class cross-entropy on reals and fakes, as in MD-GAN.
   *Generator loss*: G minimises eq. 6 itself, (1/K) sum_k W_k. Its gradient with the potentials
   held at their optimum (envelope theorem) needs only the couplings, which live on the workers:
   worker k sends F_k = dW_k/dX_g (n_g x d floats; computed after its critic steps, as MD-GAN's
   F_n), zero for generated points no real sample was transported to in any round; the master
   backpropagates (1/K) sum_k F_k through G, exactly as MD-GAN does (GeneratorSide.update). With equal critics,
   F_k averaged is -sum_j p_j grad D(x^g_j) when reals score higher: Algorithm 1's
   "Loss({D(G(z_j))}, {p_j})" with the masses p_j as weights, with no critic on the master.
   The round-T counts and F_k travel in one message, so an iteration is T round trips. (The
   master's p, and ``PWGANTrainer.masses``, is likewise the mean over the rounds.)

Traffic per worker per iteration (this algorithm's "Table III"; d floats a sample, 4 bytes each;
``traffic_per_iteration``):
    master -> worker:  4 n_g d  (X_g)  +  4 T n_g  (phi, every round)   [+ 8 n_g ACGAN labels]
    worker -> master:  4 T n_g  (N^k as int32)  +  4 n_g d  (F_k)
    worker -> worker:  0
MNIST MLP, b = 10, T = 5: 31,560 B each way (MD-GAN: 62,720 B down, 31,360 B up, plus swaps).
Sending p_j down as Algorithm 1 does, or phi^k up, would add 4 T n_g bytes each; neither is needed.

A worker lost mid-iteration leaves at once; the rounds and the generator update go on with the
workers that answered (counts and feedback are averaged over those).
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from mdgan import devices, tensor_trace
from mdgan.algorithms.base import (Algorithm, InProcessRun, InputRejected, IterationRecord, RunResult, crashing, mean,
                                   option)
from mdgan.algorithms.fixed_set import FixedSetTrainer
from mdgan.algorithms.inprocess import InProcessRounds
from mdgan.algorithms.traffic import option_of_run, rounds_run_traffic
from mdgan.config import ConfigError, TrainingConfig, named
from mdgan.data import Shard, ShardSampler
from mdgan.gan import GeneratorSide, derive_seed, make_adam
from mdgan.models import build_discriminator
from mdgan.step_results import read_scalars

log = logging.getLogger(__name__)

COUNT_DTYPE = torch.int32  # N_j^k on the wire: at most n_r, 4 bytes


@dataclass(frozen=True)
class PWGANOptions:
    """P-WGAN's own options; each field's metadata names its flag (services/common/settings.py makes the
    flags, and the MDGAN_* variables, from these fields: defined once)."""

    # T: the paper's experiments use 5
    potential_rounds: int = option(5, "--potential-rounds", "T, rounds of the Kantorovich potentials per iteration",
                                     short="T")
    # eta of eq. 9's ascent (on masses, so independent of n_r)
    potential_lr: float = option(1.0, "--potential-lr", "eta, step of the potentials' ascent (on masses)",
                                 short="eta")
    # lambda of WGAN-GP, on points between coupled pairs
    gradient_penalty: float = option(10.0, "--gradient-penalty", "lambda of the critics' gradient penalty",
                                     short="gp")

    def validate(self) -> "PWGANOptions":
        if self.potential_rounds < 1:
            raise ConfigError(f"{named('potential_rounds')} must be at least 1")
        if not (math.isfinite(self.potential_lr) and self.potential_lr > 0):
            raise ConfigError(f"{named('potential_lr')} must be a positive number, got {self.potential_lr}")
        if not (math.isfinite(self.gradient_penalty) and self.gradient_penalty >= 0):
            raise ConfigError(f"{named('gradient_penalty')} must be >= 0, got {self.gradient_penalty}")
        return self

    def check(self, config: TrainingConfig) -> "PWGANOptions":
        """These options, and the run's, checked for P-WGAN: one clear line for the first that is not."""
        check_config(config)
        return self.validate()

    def summary(self, config: TrainingConfig) -> dict:
        """What summary.json records of them (`mdgan traffic` needs T)."""
        return dataclasses.asdict(self)


def check_config(config: TrainingConfig) -> None:
    """Refuses MD-GAN's options that P-WGAN does not implement (in simulate as over gRPC)."""
    if config.wire_dtype != "float32":
        raise ConfigError(f"{named('wire_dtype')} {config.wire_dtype}: P-WGAN's batches, potentials and feedback travel "
                          "as float32 only")
    if config.aggregation != "mean":
        raise ConfigError(f"{named('aggregation')} {config.aggregation}: P-WGAN averages its critics' feedback (mean only)")
    if config.sync != "all":
        raise ConfigError(f"{named('sync')} {config.sync}: P-WGAN's rounds wait for every live worker (all only)")


# ---------------------------------------------------------------------------------------------
# the potential / mass step (pure functions; the unit test checks them against brute force)

def transport_cost(real_values: torch.Tensor, generated_values: torch.Tensor) -> torch.Tensor:
    """c_ij = |D(x_i) - D(x^g_j)| (eq. 14): real (n_r,), generated (n_g,) -> (n_r, n_g)."""
    return (real_values.unsqueeze(1) - generated_values.unsqueeze(0)).abs()


def assign_cells(cost: torch.Tensor, potentials: torch.Tensor) -> torch.Tensor:
    """sigma(i) = argmin_j c_ij - phi_j (eq. 10's Voronoi cells), ties to the lowest j: (n_r,) int64."""
    return torch.argmin(cost - potentials.unsqueeze(0), dim=1)


def transport_under(plan: torch.Tensor, real_values: torch.Tensor, generated_values: torch.Tensor) -> torch.Tensor:
    """W = (1/n_r) sum_ij pi_ij |D(x_i) - D(x^g_j)|, pi (n_r, n_g) with rows summing to 1."""
    return (plan * transport_cost(real_values, generated_values)).sum(dim=1).mean()


def voronoi_counts(cost: torch.Tensor, potentials: torch.Tensor) -> torch.Tensor:
    """N_j = #{i : x_i in Vor_phi_j}: (n_g,) int32."""
    return torch.bincount(assign_cells(cost, potentials), minlength=cost.shape[1]).to(COUNT_DTYPE)


def worker_potentials(potentials: torch.Tensor, counts: torch.Tensor, eta: float) -> torch.Tensor:
    """phi^k_j = phi_j + eta (1/n_g - N^k_j / n_r): one step of eq. 9's ascent on worker k's cells."""
    n_g, n_r = counts.shape[0], int(counts.sum())
    return potentials + eta * (1.0 / n_g - counts.to(potentials.dtype) / n_r)


def potential_step(potentials: torch.Tensor, counts: list[torch.Tensor], eta: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The master's step of one round: (averaged potentials (1/K) sum_k phi^k, masses p).

    p_j = (1/K) sum_k N^k_j / n_r^k (eq. 13, normalised so that sum_j p_j = 1). Summed in the
    order given (worker rank order): repeatable, the same in every transport.
    """
    if not counts:
        raise ValueError("no counts to average")
    phi = worker_potentials(potentials, counts[0], eta)
    masses = counts[0].to(potentials.dtype) / int(counts[0].sum())
    for n in counts[1:]:
        phi = phi + worker_potentials(potentials, n, eta)
        masses = masses + n.to(potentials.dtype) / int(n.sum())
    return phi / len(counts), masses / len(counts)


# ---------------------------------------------------------------------------------------------
# messages

@dataclass(frozen=True)
class PotentialOrder:
    """Master -> worker, once per round."""

    iteration: int
    round: int  # 1..T
    potentials: torch.Tensor  # phi: (n_g,) float32
    generated: torch.Tensor | None = None  # X_g: (n_g, *sample_shape), round 1 only
    generated_labels: torch.Tensor | None = None  # (n_g,) int64, ACGAN, round 1 only
    last: bool = False  # round T: also train the critic and send the feedback


@dataclass
class CriticResult:
    feedback: torch.Tensor  # F_k = dW_k/dX_g: (n_g, *sample_shape) float32
    transport_cost: float  # W_k under the critic after its steps (the generator's loss)
    disc_loss: float  # -W_k + lambda GP (+ class cross-entropy), last critic step
    disc_seconds: float = 0.0
    feedback_seconds: float = 0.0


@dataclass
class RoundReply:
    """Worker -> master, once per round."""

    counts: torch.Tensor  # N^k: (n_g,) int32, summing to n_r
    result: CriticResult | None = None  # the last round only


# ---------------------------------------------------------------------------------------------
# worker side

class CriticSide:
    """Worker k of Algorithm 2: a critic D_k, its shard, and the state of the current iteration."""

    def __init__(self, config: TrainingConfig, shard: Shard, options: PWGANOptions):
        self.config = config
        self.options = options
        self.spec = config.model
        self.device = devices.resolve(config.device)
        # All D_k start equal (the same seed as MD-GAN's D_n); the paper lets them drift apart.
        self.critic = build_discriminator(self.spec, derive_seed(config.seed, "discriminator-init")).to(self.device)
        tensor_trace.watch(self.critic, f"D{shard.index}")
        if self.device.type != "cpu":
            shard = dataclasses.replace(shard, images=shard.images.to(self.device), labels=shard.labels.to(self.device))
        self.optimizer = make_adam(self.critic, config.discriminator_optimizer)
        self.sampler = ShardSampler(shard, config.batch_size, derive_seed(config.seed, "worker-sampling", shard.index))
        self._penalty_noise = torch.Generator().manual_seed(derive_seed(config.seed, "pwgan-penalty", shard.index))
        self._iteration: int | None = None
        self._round = 0
        self._batch: dict = {}
        self._plan: torch.Tensor | None = None  # (n_r, n_g): how many rounds real i spent in cell j

    @property
    def shard_index(self) -> int:
        return self.sampler.shard.index

    def handle(self, order: PotentialOrder) -> RoundReply:
        """One round. Raises ValueError on an order that does not follow the protocol."""
        if order.round == 1:
            self._check_batch(order.generated, order.generated_labels)
            self._begin(order.iteration, order.generated, order.generated_labels)
        elif order.iteration != self._iteration or order.generated is not None or order.round != self._round + 1:
            raise ValueError(f"round {order.round} of iteration {order.iteration} without its round 1 "
                             f"and the rounds before it")
        cost = self._batch["cost"]
        if tuple(order.potentials.shape) != (cost.shape[1],) or not torch.isfinite(order.potentials).all():
            raise ValueError(f"potentials of shape {tuple(order.potentials.shape)}, expected ({cost.shape[1]},) "
                             f"finite floats")
        self._round = order.round
        potentials = order.potentials.to(self.device, cost.dtype)
        cells = assign_cells(cost, potentials)  # (n_r,)
        self._plan[torch.arange(cells.shape[0], device=cells.device), cells] += 1
        counts = torch.bincount(cells, minlength=cost.shape[1]).to(COUNT_DTYPE).cpu()
        result = self._finish() if order.last else None
        return RoundReply(counts, result)

    def _check_batch(self, generated: torch.Tensor | None, labels: torch.Tensor | None) -> None:
        if generated is None:
            raise ValueError("round 1 must carry the generated batch")
        shape = (self.config.batch_size, *self.spec.sample_shape)
        if tuple(generated.shape) != shape or not generated.is_floating_point() or not torch.isfinite(generated).all():
            raise ValueError(f"generated batch of shape {tuple(generated.shape)}, expected finite floats {shape}")
        if self.spec.conditional and (labels is None or tuple(labels.shape) != shape[:1] or labels.is_floating_point()
                                      or int(labels.min()) < 0 or int(labels.max()) >= self.spec.num_classes):
            raise ValueError(f"an ACGAN batch needs {shape[0]} integer labels in [0, {self.spec.num_classes})")

    def _begin(self, iteration: int, generated: torch.Tensor, labels: torch.Tensor | None) -> None:
        real, real_labels = self.sampler.next_batch()  # (n_r, *shape), (n_r,)
        generated = generated.to(self.device)
        labels = None if labels is None else labels.to(self.device)
        with torch.no_grad():  # Algorithm 2 evaluates the costs once, before the rounds
            cost = transport_cost(self.critic(real)[:, 0], self.critic(generated)[:, 0])  # (n_r, n_g)
        self._iteration = iteration
        self._plan = torch.zeros_like(cost)
        self._batch = {"real": real, "real_labels": real_labels, "generated": generated, "labels": labels,
                       "cost": cost}

    def _penalty(self, real: torch.Tensor, generated: torch.Tensor, plan: torch.Tensor) -> torch.Tensor:
        """WGAN-GP's penalty on points between each real sample and a fake it is coupled to (drawn
        from its row of the plan)."""
        partner = torch.multinomial(plan.cpu(), 1, generator=self._penalty_noise).squeeze(1).to(self.device)
        coupled = generated[partner]
        e = torch.rand(real.shape[0], *([1] * (real.dim() - 1)), generator=self._penalty_noise).to(self.device)
        between = (e * real + (1 - e) * coupled).requires_grad_(True)
        (grad,) = torch.autograd.grad(self.critic(between)[:, 0].sum(), between, create_graph=True)
        return ((grad.flatten(1).norm(dim=1) - 1) ** 2).mean()

    def _finish(self) -> CriticResult:
        b, spec, critic = self._batch, self.spec, self.critic
        real, generated = b["real"], b["generated"]
        plan = self._plan / self._plan.sum(dim=1, keepdim=True)  # pi: (n_r, n_g), rows sum to 1
        started = time.perf_counter()
        disc_loss = torch.tensor(float("nan"))
        for _ in range(self.config.disc_steps):
            real_out, fake_out = critic(real), critic(generated)
            w = transport_under(plan, real_out[:, 0], fake_out[:, 0])  # W_k under the coupling
            disc_loss = -w
            if self.options.gradient_penalty:
                disc_loss = disc_loss + self.options.gradient_penalty * self._penalty(real, generated, plan)
            if spec.conditional:
                disc_loss = disc_loss + F.cross_entropy(real_out[:, 1:], b["real_labels"]) \
                    + F.cross_entropy(fake_out[:, 1:], b["labels"])
            self.optimizer.zero_grad(set_to_none=True)
            disc_loss.backward()
            self.optimizer.step()
        trained = time.perf_counter()
        x = generated.detach().clone().requires_grad_(True)
        with torch.no_grad():
            real_values = critic(real)[:, 0]
        out = critic(x)
        w = transport_under(plan, real_values, out[:, 0])
        gen_loss = w + F.cross_entropy(out[:, 1:], b["labels"]) if spec.conditional else w
        (feedback,) = torch.autograd.grad(gen_loss, x)  # (n_g, *shape)
        self._batch, self._plan, self._iteration = {}, None, None  # the iteration is over
        transport, critic_loss = read_scalars(w, disc_loss)  # (one host read an iteration)
        return CriticResult(feedback, transport, critic_loss, trained - started, time.perf_counter() - trained)


# ---------------------------------------------------------------------------------------------
# the training loop over abstract handles

class CriticHandle(abc.ABC):
    """What the P-WGAN loop sees of a worker, wherever it runs."""

    worker_id: str
    shard_index: int  # fixes the worker's rank order
    shard_size: int

    @abc.abstractmethod
    async def round(self, order: PotentialOrder) -> RoundReply:
        """Send one round's order, get the counts (and, last round, the feedback). Raises WorkerLost
        or InputRejected."""

    @abc.abstractmethod
    async def stop(self, reason: str) -> None:
        """The run is over (or this worker is dropped from it)."""


class InProcessCritic(InProcessRounds, CriticHandle):
    """CriticSide in this process (mdgan/algorithms/inprocess.py)."""


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def check_reply(reply: RoundReply, n_g: int, n_r: int, last: bool, sample_shape: tuple[int, ...]) -> None:
    """Raises InputRejected when a reply does not fit the order it answers."""
    counts = reply.counts
    if counts.dtype != COUNT_DTYPE or tuple(counts.shape) != (n_g,):
        raise InputRejected("bad_counts", f"counts {counts.dtype} {tuple(counts.shape)}, expected int32 ({n_g},)")
    if int(counts.min()) < 0 or int(counts.sum()) != n_r:
        raise InputRejected("bad_counts", f"counts must be >= 0 and sum to n_r = {n_r}")
    if last:
        if reply.result is None or tuple(reply.result.feedback.shape) != (n_g, *sample_shape) \
                or not torch.isfinite(reply.result.feedback).all():
            raise InputRejected("bad_feedback", f"the last round needs finite feedback of shape {(n_g, *sample_shape)}")


class PWGANTrainer(FixedSetTrainer):
    """Runs I iterations of Algorithm 1 (the master) against critic handles (mdgan/algorithms/fixed_set.py:
    a lost worker leaves for good; the run goes on while any is left)."""

    def __init__(self, config: TrainingConfig, options: PWGANOptions, generator: GeneratorSide,
                 workers: list[CriticHandle], *, step_timeout: float | None = None,
                 on_iteration: Callable[[IterationRecord], None] | None = None, stop_after: int | None = None):
        super().__init__(config, workers, step_timeout=step_timeout, on_iteration=on_iteration, stop_after=stop_after)
        self.options = options.validate()
        self.generator = generator
        self.masses: torch.Tensor | None = None  # p of the last iteration, averaged over its rounds (n_g,)
        self.last_round_masses: torch.Tensor | None = None  # p of the last iteration's last round (n_g,)
        self.potentials: torch.Tensor | None = None  # phi after the last iteration's rounds (n_g,)

    async def iteration(self, t: int) -> IterationRecord:
        started = time.perf_counter()
        config, options = self.config, self.options
        batches = self.generator.generate(1)
        generated = batches.samples.detach()[0]  # X_g: (n_g, *shape)
        labels = None if batches.labels is None else batches.labels[0]
        n_g = generated.shape[0]
        phi = torch.zeros(n_g, dtype=torch.float32)
        participants, rejected, lost = list(self.active), 0, 0
        active_at_start = len(participants)
        generated_at = time.perf_counter()
        results: list[CriticResult] = []
        wait, mass_sum, rounds_done = 0.0, None, 0
        for r in range(1, options.potential_rounds + 1):
            last = r == options.potential_rounds
            order = PotentialOrder(t, r, phi.clone(), generated if r == 1 else None, labels if r == 1 else None, last)
            asked = time.perf_counter()
            replies = await self.ask(t, r, participants, order, lambda reply: check_reply(
                reply, n_g, config.batch_size, last, tuple(config.model.sample_shape)))
            wait += time.perf_counter() - asked
            rejected, lost = rejected + len(replies.rejected), lost + len(replies.lost)
            self.traffic.payload_bytes["server_to_worker"] += len(participants) * (
                _nbytes(order.potentials) + _nbytes(order.generated))
            self.traffic.label_bytes += len(participants) * _nbytes(order.generated_labels)
            counts, answered = [], []
            for worker, reply in replies.good:
                self.traffic.payload_bytes["worker_to_server"] += _nbytes(reply.counts) + (
                    _nbytes(reply.result.feedback) if last else 0)
                counts.append(reply.counts)
                answered.append(worker)
                if last:
                    results.append(reply.result)
            participants = answered  # rank order kept
            if not counts:
                break
            phi, masses = potential_step(phi, counts, options.potential_lr)
            mass_sum, rounds_done = (masses if mass_sum is None else mass_sum + masses), r
            self.last_round_masses = masses
        self.potentials = phi
        if mass_sum is not None:
            self.masses = mass_sum / rounds_done
        self.rejections += rejected
        answered_at = time.perf_counter()
        if results:  # F_k in rank order: (1/K) sum_k F_k through G
            self.generator.update(batches, [(0, res.feedback) for res in results])
        updated = time.perf_counter()
        return IterationRecord(
            iteration=t, active_workers=active_at_start, answered=len(results), rejected=rejected, lost=lost,
            gen_loss=mean([res.transport_cost for res in results]), disc_loss=mean([res.disc_loss for res in results]),
            real_accuracy=float("nan"), fake_accuracy=float("nan"), swap_round=None, seconds=updated - started,
            generate_seconds=generated_at - started, wait_seconds=wait, update_seconds=updated - answered_at)


def traffic_per_iteration(config: TrainingConfig, options: PWGANOptions, workers: int) -> dict[str, int]:
    """This algorithm's Table III: payload bytes of one iteration with `workers` workers answering.

    Per worker: down 4 n_g d + 4 T n_g, up 4 T n_g + 4 n_g d (n_g = n_r = b), labels 8 n_g (ACGAN).
    """
    n_g, d, rounds = config.batch_size, config.model.sample_size, options.potential_rounds
    per_worker = 4 * n_g * d + 4 * rounds * n_g
    return {"server_to_worker": workers * per_worker, "worker_to_server": workers * per_worker,
            "worker_to_worker": 0, "label_bytes": workers * 8 * n_g if config.model.conditional else 0}


def build_in_process_critics(config: TrainingConfig, options: PWGANOptions, shards: list[Shard]) -> list[InProcessCritic]:
    return [InProcessCritic(CriticSide(config, shard, options)) for shard in shards]


def run_in_process(run: InProcessRun) -> RunResult:
    """P-WGAN in one process (`mdgan simulate`); a worker fails every run.emulation.crash_every iterations."""
    options = (run.options or PWGANOptions()).check(run.config)
    workers = build_in_process_critics(run.config, options, run.shards)
    after = crashing(run.recorder, run.emulation.crash_every, lambda: [w for w in workers if not w.crashed])
    return asyncio.run(PWGANTrainer(run.config, options, run.generator, workers, on_iteration=after,
                                    stop_after=run.stop_after).run())


def per_worker_per_iteration(config: TrainingConfig, shard_size: int, options: PWGANOptions | None) -> dict[str, float]:
    formula = traffic_per_iteration(config, options or PWGANOptions(), 1)
    return {k: formula[k] for k in ("server_to_worker", "worker_to_server", "worker_to_worker")}


def _per_iteration_of_run(summary: dict, workers: int) -> dict[str, int]:
    options = PWGANOptions(potential_rounds=int(option_of_run(summary, "pwgan", "potential_rounds")))
    return traffic_per_iteration(TrainingConfig.from_dict(summary["config"]), options, workers)


ALGORITHM = Algorithm(
    name="pwgan", title="the parallel Wasserstein GAN (P-WGAN)", run_in_process=run_in_process,
    per_worker_per_iteration=per_worker_per_iteration, run_traffic=rounds_run_traffic(_per_iteration_of_run),
    options=PWGANOptions)
