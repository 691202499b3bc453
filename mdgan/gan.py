"""Both sides of one MD-GAN global iteration (DESIGN.md section 1, the paper's Algorithm 1).

GeneratorSide lives on the server: it generates kappa batches, assigns them, and turns the
workers' per-sample feedback into one Adam step of G. DiscriminatorSide lives on a worker: L
discriminator steps on (real, X_d), then the feedback F_n = dJ_gen(X_g)/dX_g. Nothing here knows
how the two sides talk.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import random
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mdgan import aggregation
from mdgan.adam import Adam
from mdgan.config import ModelSpec, OptimizerSpec, TrainingConfig
from mdgan.cuda_graphs import StepGraphs, StepInputs
from mdgan.data import Shard, ShardSampler
from mdgan import devices, tensor_trace
from mdgan.devices import to_device
from mdgan.step_results import DiscriminatorStats, StepResult
from mdgan.models import build_discriminator, build_generator
from mdgan.privacy_ledger import PrivacyLedger, adopt_old_accountant, site_ledger


def derive_seed(seed: int, role: str, index: int = 0) -> int:
    """An independent 63-bit seed per role (server noise, worker sampling, initialisation, swaps)."""
    digest = hashlib.blake2b(f"{seed}/{role}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def make_adam(module: nn.Module, spec: OptimizerSpec) -> torch.optim.Adam:
    # torch's per-tensor loop's arithmetic (mdgan/adam.py): one rounding everywhere, bitwise repeatable on every device
    return Adam(module.parameters(), lr=spec.lr, betas=(spec.beta1, spec.beta2))


def assignment(rank: int, kappa: int) -> tuple[int, int]:
    """(index of X_g, index of X_d) for the worker of this rank among the active workers."""
    return rank % kappa, (rank + 1) % kappa


# ---------------------------------------------------------------------------------------------
# losses. D outputs logits: column 0 is real/fake, columns 1.. are the ACGAN class logits.

def discriminator_loss(spec: ModelSpec, real_logits: torch.Tensor, real_labels: torch.Tensor,
                       fake_logits: torch.Tensor, fake_labels: torch.Tensor | None) -> torch.Tensor:
    """J_disc, minimised: -[log D(x_r) + log(1 - D(x_d))] (+ class cross-entropy on both)."""
    loss = (F.binary_cross_entropy_with_logits(real_logits[:, 0], torch.ones_like(real_logits[:, 0]))
            + F.binary_cross_entropy_with_logits(fake_logits[:, 0], torch.zeros_like(fake_logits[:, 0])))
    if spec.conditional:
        loss = loss + F.cross_entropy(real_logits[:, 1:], real_labels) + F.cross_entropy(fake_logits[:, 1:], fake_labels)
    return loss


def discriminator_term(spec: ModelSpec, logits: torch.Tensor, labels: torch.Tensor | None, real: bool,
                       reduction: str = "mean") -> torch.Tensor:
    """One part of J_disc: -log D(x) on real samples, -log(1 - D(x)) on generated ones (+ their class
    cross-entropy): the mean, or each sample's (n,) with reduction "none" (DP-SGD's clipping)."""
    source = logits[:, 0]
    loss = F.binary_cross_entropy_with_logits(source, torch.ones_like(source) if real else torch.zeros_like(source),
                                              reduction=reduction)
    if spec.conditional:
        loss = loss + F.cross_entropy(logits[:, 1:], labels, reduction=reduction)
    return loss


def generator_loss(spec: ModelSpec, fake_logits: torch.Tensor, fake_labels: torch.Tensor | None) -> torch.Tensor:
    """J_gen on one batch (a mean over its b samples).

    non-saturating (default): -log D(G(z)), the usual choice, since log(1 - D(G(z))) has vanishing
    gradients while D wins early in training; saturating: log(1 - D(G(z))) as written in the paper.
    ACGAN adds the class cross-entropy of the generated samples.
    """
    source = fake_logits[:, 0]
    if spec.loss == "non-saturating":
        loss = F.binary_cross_entropy_with_logits(source, torch.ones_like(source))
    else:
        loss = -F.binary_cross_entropy_with_logits(source, torch.zeros_like(source))  # mean log(1 - D)
    if spec.conditional:
        loss = loss + F.cross_entropy(fake_logits[:, 1:], fake_labels)
    return loss


# ---------------------------------------------------------------------------------------------
# server side

@dataclass
class GeneratedBatches:
    """The kappa batches of one iteration, with the graph kept for the backward pass."""

    samples: torch.Tensor  # (kappa, b, *sample_shape), requires grad
    labels: torch.Tensor | None  # (kappa, b) int64, ACGAN only
    noise: torch.Tensor | None = None  # (kappa*b, l): z, to generate the same batches again (--sync async)
    generation: int = 0  # which call of the GeneratorSide made them (--sync async makes several an iteration)

    @property
    def kappa(self) -> int:
        return self.samples.shape[0]

    def for_worker(self, rank: int) -> "WorkerBatch":
        g, d = assignment(rank, self.kappa)
        detached = self.samples.detach()
        labels = self.labels
        return WorkerBatch(detached[g], None if labels is None else labels[g],
                           detached[d], None if labels is None else labels[d], g, self.generation)


@dataclass
class WorkerBatch:
    """What the server sends to one worker in one iteration."""

    generated: torch.Tensor  # X_g: (b, *sample_shape), the feedback is computed on it
    generated_labels: torch.Tensor | None  # (b,)
    discriminated: torch.Tensor  # X_d: (b, *sample_shape), D trains on it
    discriminated_labels: torch.Tensor | None  # (b,)
    generated_index: int  # which of the kappa batches X_g is
    generation: int = 0  # the GeneratedBatches' generation it was cut from (0: not made by a GeneratorSide here)

    def to(self, device: torch.device) -> "WorkerBatch":
        """The batch on `device` (from the CPU without waiting for the GPU: devices.to_device); itself if it is there."""
        tensors = {"generated": self.generated, "generated_labels": self.generated_labels,
                   "discriminated": self.discriminated, "discriminated_labels": self.discriminated_labels}
        if all(t is None or t.device == device for t in tensors.values()):
            return self
        return dataclasses.replace(self, **{k: None if t is None else to_device(t, device) for k, t in tensors.items()})


class GeneratorSide:
    def __init__(self, config: TrainingConfig, trace_as: str = "G"):
        """trace_as: G's name in a run's tensor trace (mdgan/tensor_trace.py; an FL-GAN worker's G has its own)."""
        self.config = config
        self.spec = config.model
        self.device = devices.resolve(config.device)
        self.generator = build_generator(self.spec, derive_seed(config.seed, "generator-init")).to(self.device)
        tensor_trace.watch(self.generator, trace_as)
        self.optimizer = make_adam(self.generator, config.generator_optimizer)
        self._noise = torch.Generator().manual_seed(derive_seed(config.seed, "server-noise"))
        self._generations = itertools.count(1)  # GeneratedBatches.generation

    def generate(self, kappa: int) -> GeneratedBatches:
        b, spec = self.config.batch_size, self.spec
        z = torch.randn(kappa * b, spec.latent_dim, generator=self._noise)  # (kappa*b, l), drawn on the CPU
        labels = torch.randint(0, spec.num_classes, (kappa * b,), generator=self._noise) if spec.conditional else None
        z, labels = to_device(z, self.device), None if labels is None else to_device(labels, self.device)
        samples = self.generator(z, labels)  # (kappa*b, *sample_shape)
        return GeneratedBatches(samples.view(kappa, b, *spec.sample_shape),
                                None if labels is None else labels.view(kappa, b), z, next(self._generations))

    def regenerate(self, batches: GeneratedBatches) -> GeneratedBatches:
        """The same noise and labels through the current G (a new graph; for stale feedback)."""
        kappa, b = batches.samples.shape[:2]
        labels = None if batches.labels is None else batches.labels.reshape(-1)
        samples = self.generator(batches.noise, labels)
        return GeneratedBatches(samples.view(kappa, b, *self.spec.sample_shape), batches.labels, batches.noise,
                                next(self._generations))

    def accumulate(self, batches: GeneratedBatches, feedback: list[tuple[int, torch.Tensor]]) -> None:
        """Backpropagate (1/N) sum_n F_n (or a robust rule's stand-in) through G; feedback is
        [(index of X_g, F_n (b, *shape))].

        Summed in the order given (worker rank order), never arrival order: bit-for-bit repeatable.
        """
        if not feedback:
            raise ValueError("no feedback to update from")
        cfg = self.config  # mean (the paper), or a rule robust to wrong feedback: mdgan/aggregation.py
        incoming = aggregation.combine(batches.samples, feedback, cfg.aggregation, cfg.trim_fraction, cfg.clip_norm)
        self.optimizer.zero_grad(set_to_none=True)
        batches.samples.backward(incoming)

    def update(self, batches: GeneratedBatches, feedback: list[tuple[int, torch.Tensor]]) -> None:
        self.accumulate(batches, feedback)
        self.optimizer.step()

    def state_dict(self) -> dict:
        """G, its Adam state and the noise generator: everything the server's side of an iteration uses."""
        return {"generator": self.generator.state_dict(), "optimizer": self.optimizer.state_dict(),
                "noise_rng": self._noise.get_state(), "torch_rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.load_state_dict(state["generator"])
        self.optimizer.load_state_dict(state["optimizer"])
        self._noise.set_state(state["noise_rng"])
        torch.set_rng_state(state["torch_rng"])

    @torch.no_grad()
    def sample(self, z: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        """G(z, labels) in eval mode, returned on the CPU."""
        self.generator.eval()
        try:
            return self.generator(z.to(self.device), None if labels is None else labels.to(self.device)).cpu()
        finally:
            self.generator.train()


# ---------------------------------------------------------------------------------------------
# worker side

class DiscriminatorSide:
    def __init__(self, config: TrainingConfig, shard: Shard, ledger: PrivacyLedger | None = None):
        """`ledger`: with DP, the site's privacy ledger (mdgan/privacy_ledger.py) its steps are counted in and its
        secret noise drawn by; None: one kept in memory, with the secret --dp-fixed-noise makes or a new one."""
        self.config = config
        self.spec = config.model
        self.device = devices.resolve(config.device)
        # All D_n start equal, as the paper assumes (section IV-A).
        self.discriminator = build_discriminator(self.spec, derive_seed(config.seed, "discriminator-init")).to(self.device)
        tensor_trace.watch(self.discriminator, f"D{shard.index}")
        if self.device.type != "cpu":  # the shard lives where D computes
            shard = dataclasses.replace(shard, images=shard.images.to(self.device), labels=shard.labels.to(self.device))
        self.optimizer = make_adam(self.discriminator, config.discriminator_optimizer)
        self.graphs = StepGraphs(self.device)  # a CUDA step's graphs (mdgan/cuda_graphs.py), captured at its first
        self.sampler = ShardSampler(shard, config.batch_size, derive_seed(config.seed, "worker-sampling", shard.index))
        # the generated samples of the last batch trained on, X_d: (b, *shape), (b,) or None; the
        # swap check's generated half (mdgan/algorithms/mdgan/swapcheck.py)
        self.last_discriminated: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._scratch: torch.nn.Module | None = None
        self.private = None  # DP-SGD on the real data (mdgan/privacy.py), when the run asks for it
        if config.privacy.enabled:
            from mdgan import privacy

            privacy.check_module(self.discriminator, self.spec.architecture)
            site = privacy.resolve(config.privacy, len(shard), config.batch_size, config.iterations, config.disc_steps)
            ledger = ledger or site_ledger(config.privacy, shard.index, None, "")  # (None: in memory)
            self.private = privacy.PrivateSteps(self.discriminator, self.optimizer, site, config.batch_size, ledger)

    def check_module(self) -> torch.nn.Module:
        """A scratch copy of D's module (eval mode) to judge an incoming state on, made once."""
        if self._scratch is None:  # (eval mode: no dropout, no running statistics updated; no DP hooks)
            self._scratch = build_discriminator(self.spec, 0).to(self.device).eval().requires_grad_(False)
        return self._scratch

    @property
    def shard(self) -> Shard:
        return self.sampler.shard

    @property
    def shard_index(self) -> int:
        return self.sampler.shard.index

    def step(self, batch: WorkerBatch) -> StepResult:
        if self.private is not None:
            return self._private_step(batch)
        disc = self.discriminator
        started = time.perf_counter()
        real, real_labels = self.sampler.next_batch()  # X_r: (b, *shape), (b,)
        batch = batch.to(self.device)
        if self.config.disc_steps and self.graphs.enabled:
            inputs = StepInputs(real, real_labels, batch.discriminated, batch.discriminated_labels, batch.generated,
                                batch.generated_labels)
            graphed = self.graphs.for_inputs(disc, self.optimizer, self._disc_losses, self._gen_loss, inputs)
            if graphed is not None:  # (mdgan/cuda_graphs.py: the same arithmetic as below, in a few launches)
                stats = graphed.disc_steps(inputs, self.config.disc_steps)
                self.last_discriminated = (batch.discriminated.detach(), batch.discriminated_labels)
                trained = time.perf_counter()
                answer = graphed.feedback()
                return StepResult(answer.feedback, stats.loss, answer.gen_loss, stats.real_accuracy,
                                  stats.fake_accuracy, trained - started, time.perf_counter() - trained)
        disc_loss = real_acc = fake_acc = float("nan")
        real_logits = fake_logits = None
        for _ in range(self.config.disc_steps):
            disc_loss, real_logits, fake_logits = self._disc_losses(real, real_labels, batch.discriminated,
                                                                    batch.discriminated_labels)
            self.optimizer.zero_grad(set_to_none=True)
            disc_loss.backward()
            self.optimizer.step()
        if real_logits is not None:  # the last D step's, left on the device (read_stats)
            disc_loss = disc_loss.detach()
            real_acc = (real_logits[:, 0] > 0).float().mean()
            fake_acc = (fake_logits[:, 0] <= 0).float().mean()
        self.last_discriminated = (batch.discriminated.detach(), batch.discriminated_labels)

        trained = time.perf_counter()
        generated = batch.generated.detach().clone().requires_grad_(True)
        gen_loss = self._gen_loss(generated, batch.generated_labels)
        (feedback,) = torch.autograd.grad(gen_loss, generated)  # (b, *shape)
        return StepResult(feedback, disc_loss, gen_loss.detach(), real_acc, fake_acc,
                          trained - started, time.perf_counter() - trained)

    def _disc_losses(self, real: torch.Tensor, real_labels: torch.Tensor | None, fake: torch.Tensor,
                     fake_labels: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """J_disc on (X_r, X_d), with D's logits on each: (b, 1 [+ C])."""
        real_logits, fake_logits = self.discriminator(real), self.discriminator(fake)
        loss = discriminator_loss(self.spec, real_logits, real_labels, fake_logits, fake_labels)
        return loss, real_logits, fake_logits

    def _gen_loss(self, generated: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        """J_gen(X_g) under this D."""
        return generator_loss(self.spec, self.discriminator(generated), labels)

    def _private_step(self, batch: WorkerBatch) -> StepResult:
        """DP-SGD (mdgan/privacy.py): the real part on a Poisson sample, clipped per sample and noised;
        the generated part (public) added as usual; then the feedback, as without DP."""
        spec, disc, private = self.spec, self.discriminator, self.private
        started = time.perf_counter()
        batch = batch.to(self.device)
        stats = self.private_disc_steps(batch.discriminated, batch.discriminated_labels)
        self.last_discriminated = (batch.discriminated.detach(), batch.discriminated_labels)
        trained = time.perf_counter()
        generated = batch.generated.detach().clone().requires_grad_(True)
        gen_loss = generator_loss(spec, disc(generated), batch.generated_labels)
        (feedback,) = torch.autograd.grad(gen_loss, generated)  # (b, *shape)
        return StepResult(feedback, stats.loss, gen_loss.detach(), stats.real_accuracy, stats.fake_accuracy,
                          trained - started, time.perf_counter() - trained, private.epsilon(), private.site.delta,
                          private.ledger.secret.fixed)

    def private_disc_steps(self, fake: torch.Tensor, fake_labels: torch.Tensor | None) -> DiscriminatorStats:
        """The L DP-SGD steps of D against the generated batch `fake` (b, *shape) (public) and Poisson
        samples of the shard (private): the loss and accuracies of the last step, left on D's device.
        MD-GAN's worker step and the FL-GAN/standalone local GAN (mdgan/algorithms/standalone.py) both train
        their D with it."""
        spec, disc, private = self.spec, self.discriminator, self.private
        shard = self.sampler.shard
        parameters = [p for p in disc.parameters() if p.requires_grad]
        nan = torch.full((), float("nan"), device=self.device)  # (made on the device: no host copy)
        stats = DiscriminatorStats(nan, nan, nan)
        for _ in range(self.config.disc_steps):
            picked = private.sample(len(shard))  # (n,), n ~ Binomial(m, b/m)
            real, real_labels = shard.images[picked.to(shard.images.device)], shard.labels[picked.to(shard.labels.device)]
            seen: dict[str, torch.Tensor] = {}

            def per_sample_losses():
                if len(real) == 0:
                    return None
                logits = disc(real)  # (n, 1 [+ C])
                seen["logits"] = logits.detach()
                return discriminator_term(spec, logits, real_labels, real=True, reduction="none")  # (n,)

            def generated_losses():
                logits = disc(fake)  # (b, 1 [+ C])
                losses = discriminator_term(spec, logits, fake_labels, real=False, reduction="none")  # (b,)
                seen["fake_logits"], seen["fake_loss"] = logits.detach(), losses.detach().mean()
                return losses

            private.real_step(parameters, per_sample_losses)
            if self.config.privacy.clip_generated:
                private.generated_step(parameters, generated_losses)
                fake_logits, fake_loss = seen["fake_logits"], seen["fake_loss"]
            else:
                fake_logits = disc(fake)
                fake_loss = discriminator_term(spec, fake_logits, fake_labels, real=False)
                fake_loss.backward()  # adds to the private real part's .grad
            private.step()
            real_logits = seen.get("logits")
            # the loss is summed in float64 from its float32 terms: (real [+ class]) + (generated [+ class])
            real_loss, real_acc = nan.double(), stats.real_accuracy  # (an empty sample: no real loss, the last accuracy)
            if real_logits is not None:
                real_loss = F.binary_cross_entropy_with_logits(real_logits[:, 0],
                                                               torch.ones_like(real_logits[:, 0])).double()
                if spec.conditional:
                    real_loss = real_loss + F.cross_entropy(real_logits[:, 1:], real_labels).double()
                real_acc = (real_logits[:, 0] > 0).float().mean()
            stats = DiscriminatorStats(real_loss + fake_loss.detach().double(), real_acc,
                                       (fake_logits[:, 0] <= 0).float().mean())
        return stats

    # -- durable state (a checkpoint, kept on the worker) ------------------------------------------
    def state_dict(self) -> dict:
        """D, its Adam state and the shard sampler's state. With DP only a marker: what the site spent and the
        state of its noise are in its ledger, which a restore never winds back."""
        state = {"discriminator": self.discriminator.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "sampler": self.sampler.state_dict(), "shard_index": self.shard_index}
        if self.private is not None:
            state["privacy"] = {"ledger": True}
        return state

    def load_state_dict(self, state: dict) -> None:
        if int(state["shard_index"]) != self.shard_index:
            raise ValueError(f"saved state of shard {state['shard_index']}, this worker holds shard {self.shard_index}")
        self.discriminator.load_state_dict(state["discriminator"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.sampler.load_state_dict(state["sampler"])
        if self.private is not None:
            if "privacy" not in state:
                raise ValueError("saved state of a run without DP; this run is private")
            adopt_old_accountant(self.private.ledger, state["privacy"])

    def adopt(self, state: dict[str, torch.Tensor]) -> None:
        """Take a copy of a live peer's discriminator (a late joiner, as in the paper): weights only,
        Adam starts afresh."""
        self.discriminator.load_state_dict({n: state[n] for n in self.discriminator.state_dict()})
        self.optimizer.state.clear()

    # -- swap ------------------------------------------------------------------------------------
    def export_state(self) -> dict[str, torch.Tensor]:
        """D's weights (and Adam moments when configured), as named contiguous tensors."""
        state = {name: t.detach().clone() for name, t in self.discriminator.state_dict().items()}
        if self.config.swap_optimizer_state:
            state.update(self._optimizer_tensors())
        return state

    def state_layout(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The names, shapes and dtypes an incoming state must have."""
        layout = {n: (tuple(t.shape), t.dtype) for n, t in self.discriminator.state_dict().items()}
        if self.config.swap_optimizer_state:
            for name, param in self.discriminator.named_parameters():
                layout[f"adam.{name}.exp_avg"] = (tuple(param.shape), param.dtype)
                layout[f"adam.{name}.exp_avg_sq"] = (tuple(param.shape), param.dtype)
                layout[f"adam.{name}.step"] = ((), torch.float32)
        return layout

    def import_state(self, state: dict[str, torch.Tensor]) -> None:
        weights = {n: state[n] for n in self.discriminator.state_dict()}
        self.discriminator.load_state_dict(weights)
        # Adam moments belong to the discriminator they were estimated for.
        self.optimizer.state.clear()
        if self.config.swap_optimizer_state:
            for name, param in self.discriminator.named_parameters():
                self.optimizer.state[param] = {
                    "step": state[f"adam.{name}.step"].to("cpu", copy=True),  # (Adam keeps its count on the CPU)
                    "exp_avg": state[f"adam.{name}.exp_avg"].clone(),
                    "exp_avg_sq": state[f"adam.{name}.exp_avg_sq"].clone(),
                }

    def _optimizer_tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, param in self.discriminator.named_parameters():
            st = self.optimizer.state.get(param, {})
            out[f"adam.{name}.exp_avg"] = st["exp_avg"].clone() if st else torch.zeros_like(param)
            out[f"adam.{name}.exp_avg_sq"] = st["exp_avg_sq"].clone() if st else torch.zeros_like(param)
            out[f"adam.{name}.step"] = st["step"].clone().float().reshape(()) if st else torch.zeros(())
        return out


def derangement(worker_ids: list[str], seed: int, swap_round: int) -> dict[str, str]:
    """sender -> receiver: a random permutation of worker_ids without fixed points.

    Seeded by (run seed, swap round), so every transport computes the same plan. Each worker
    sends exactly one discriminator and receives exactly one, from another worker.
    """
    if len(worker_ids) < 2:
        return {}
    rng = random.Random(derive_seed(seed, "swap", swap_round))
    targets = list(worker_ids)
    while True:  # rejection sampling: uniform over derangements, about e tries on average
        rng.shuffle(targets)
        if all(s != t for s, t in zip(worker_ids, targets)):
            return dict(zip(worker_ids, targets))
