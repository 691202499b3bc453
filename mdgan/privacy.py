"""Differential privacy per site: each site's settings resolved (both mechanisms), Opacus's RDP
accounting, and DP-SGD discriminators with Opacus on each site's real data (`--dp-mechanism sgd`).
Private feedback (`--dp-mechanism feedback`) is MD-GAN's: mdgan/algorithms/mdgan/private_feedback.py.

DP-SGD:

What is private, and why the rest follows (docs/PRIVACY.md has the argument in full):

- Each discriminator step's *real-data* part is computed on a Poisson sample of the site's shard
  (each of its m_n images taken independently with probability q = b / m_n, the sampling the
  accountant's guarantee assumes), every real sample's gradient is clipped to L2 norm C
  (`max_grad_norm`), the clipped gradients are summed, Gaussian noise N(0, (sigma C)^2) is added
  and the sum is divided by b (Opacus's ghost clipping: GradSampleModuleFastGradientClipping computes
  each sample's gradient norm without making its gradient, a second backward pass sums the clipped
  gradients, and DPOptimizerFastGradientClipping noises and scales the sum).
- The generated part of the step (X_d, from the server's G, which never saw the site's data) is
  added without noise: it holds no private data.
- Opacus's RDP accountant composes every step the site took (L per iteration it took part in,
  rejoins, restarts and resumes included: the site's ledger counts them) into (epsilon, delta) for the site.
- Everything that leaves the site is computed from the private D and public inputs only: the
  feedback F_n (a gradient of D's output on generated samples), the discriminator pushed at a swap,
  and so the generator. That is post-processing, which spends nothing more. The swap check of a
  private site looks at generated samples only (mdgan/algorithms/mdgan/swapcheck.py), for the same
  reason.

The noise and the Poisson draws come from the site's own secret (mdgan/secret_noise.py), never from the run's
seed, and every step is counted in the site's ledger (mdgan/privacy_ledger.py) before its result can leave:
the ledger, not the run's checkpoint, is what the site's epsilon is computed from.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from dataclasses import dataclass

# Opacus's per-sample hooks are full backward hooks on D's layers; the inputs (images) do not require
# gradients, which torch reports on every backward pass: expected here, and nothing to act on.
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with respect "
                                          "to module outputs since no inputs require gradients")

import torch

from mdgan.config import ConfigError, PrivacySpec, named
from mdgan.privacy_ledger import PrivacyLedger

ACCOUNTANT = "rdp"  # Opacus's Renyi-DP accountant (Mironov 2017; Mironov, Talwar, Zhang 2019)


def default_delta(shard_size: int) -> float:
    """1e-5, or smaller for a site of more than 10^4 images: delta below 1 / (10 m_n)."""
    return min(1e-5, 1.0 / (10 * shard_size))


@dataclass(frozen=True)
class SitePrivacy:
    """The DP parameters of one site, resolved from the run's PrivacySpec and the site's size."""

    noise_multiplier: float  # sigma: the noise's std is sigma x C
    max_grad_norm: float  # C
    delta: float
    sample_rate: float  # sgd: q = b / m_n; feedback: 1 (each answer is one part's Gaussian mechanism)
    planned_steps: int  # the steps the noise was calibrated for: sgd L x I; feedback ceil(I / K) answers a part
    target_epsilon: float | None = None
    mechanism: str = "sgd"
    discriminators: int = 1  # feedback: K parts of the site, one discriminator each
    # the Gaussian mechanism's noise over its L2 sensitivity, which the accountant composes: sgd sigma;
    # feedback sigma / (2 sqrt(b)) (a part's b clipped feedback rows can each move by 2C)
    accounted_noise_multiplier: float = 0.0
    steps_per_iteration: int = 1  # accounted steps a worker takes an iteration: sgd L, feedback 1 answer


def mechanism_summary(spec: PrivacySpec) -> dict:
    """summary.json's privacy fields that every site of a run shares: its mechanism and how it is accounted."""
    if spec.mechanism == "feedback":
        return {"mechanism": "feedback", "accountant": ACCOUNTANT, "discriminators": spec.discriminators,
                "sampling": "one part answers; parallel composition over the parts"}
    return {"mechanism": "sgd", "accountant": ACCOUNTANT, "sampling": "poisson", "clip_generated": spec.clip_generated}


# What of a step's statistics is computed on the site's real images, and so never leaves a private site: under
# DP-SGD D is private, so what it says of public (generated) inputs is post-processing and may leave, but its loss
# and accuracy on the real sample may not; under private feedback D is not private, so nothing of it leaves but
# the noised feedback.
WITHHELD_STATS = {"sgd": ("disc_loss", "real_accuracy"),
                  "feedback": ("disc_loss", "gen_loss", "real_accuracy", "fake_accuracy")}


def withheld_stats(spec: PrivacySpec) -> tuple[str, ...]:
    """The StepResult statistics a site of this run keeps to itself (none without DP)."""
    return WITHHELD_STATS.get(spec.active_mechanism, ())


def released(result, spec: PrivacySpec):
    """A site's StepResult as it may leave the site: its withheld statistics NaN (the wire carries them as 0)."""
    withheld = withheld_stats(spec)
    return dataclasses.replace(result, **{name: float("nan") for name in withheld}) if withheld else result


def released_stats(stats: dict, spec: PrivacySpec) -> dict:
    """A dict of step statistics (FL-GAN's local steps) as it may leave the site: its withheld ones NaN."""
    return {**stats, **{name: float("nan") for name in withheld_stats(spec) if name in stats}}


def budget(site: SitePrivacy, site_max_epsilon: float = 0.0) -> float:
    """The epsilon a site stops before passing: the run's target (it is also a cap) and the site's own
    --dp-max-epsilon, the smaller of those set; infinity for none."""
    caps = [e for e in (site.target_epsilon or 0.0, site_max_epsilon or 0.0) if e > 0]
    return min(caps) if caps else math.inf


def over_budget(private, site_max_epsilon: float = 0.0, steps: int | None = None) -> str | None:
    """Why a private site must not take its next iteration's step (`steps`: its next this many DP-SGD steps, an
    FL-GAN round's) because its epsilon would pass its budget, or None."""
    cap = budget(private.site, site_max_epsilon)
    if not math.isfinite(cap):
        return None
    ahead = private.epsilon_after_iteration() if steps is None else private.epsilon_after(steps)
    if ahead <= cap:
        return None
    which = "the run's --dp-target-epsilon" if cap == (private.site.target_epsilon or 0.0) else "--dp-max-epsilon"
    return (f"privacy budget spent: the next step would bring this site's epsilon to {ahead:.3f}, past {which} "
            f"{cap:g} (spent: {private.epsilon():.3f} at delta {private.site.delta:g}); it answers no more")


def resolve(spec: PrivacySpec, shard_size: int, batch_size: int, iterations: int, disc_steps: int) -> SitePrivacy:
    """The site's sigma, C, delta and sampling; one clear line (ConfigError) for a budget or setting it
    cannot have."""
    feedback = spec.mechanism == "feedback"
    if feedback and shard_size // spec.discriminators < batch_size:
        raise ConfigError(f"{named('dp_discriminators')} {spec.discriminators}: a site of {shard_size} samples split into "
                          f"{spec.discriminators} parts has parts of {shard_size // spec.discriminators}, fewer than "
                          f"a batch of {batch_size}; use at most {max(1, shard_size // batch_size)} discriminators")
    if shard_size < batch_size:
        raise ConfigError(f"DP-SGD: a site of {shard_size} samples cannot have an expected batch of {batch_size}")
    delta = spec.delta or default_delta(shard_size)
    if not 0 < delta < 1.0 / shard_size:
        raise ConfigError(f"{named('dp_delta')} {delta:g} must be in (0, 1/m) = (0, {1.0 / shard_size:.3g}) for a site of "
                          f"{shard_size} samples (delta >= 1/m lets a mechanism publish a whole record)")
    if feedback:
        q, steps, per_iteration = 1.0, max(1, math.ceil(iterations / spec.discriminators)), 1
        scale = 2 * math.sqrt(batch_size)  # the sensitivity of a part's b clipped rows, in units of C
    else:
        q, steps, per_iteration = batch_size / shard_size, max(1, iterations * disc_steps), disc_steps
        scale = 1.0
    sigma = spec.noise_multiplier
    if spec.target_epsilon:
        try:
            sigma = _sigma_for(spec.target_epsilon, delta, q, steps) * scale
        except ValueError as exc:
            raise ConfigError(f"{named('dp_target_epsilon')} {spec.target_epsilon:g}: no noise reaches it over {steps} steps "
                              f"at sampling rate {q:.3g} and delta {delta:g} ({exc})") from None
    return SitePrivacy(sigma, spec.max_grad_norm, delta, q, steps, spec.target_epsilon or None, spec.mechanism,
                       spec.discriminators, sigma / scale, per_iteration)


@functools.lru_cache(maxsize=64)
def _sigma_for(target_epsilon: float, delta: float, q: float, steps: int) -> float:
    """Opacus's search for the sigma that spends `target_epsilon` (seconds a search; a process asks for the
    same site's several times: the check before the run, then the site's discriminator)."""
    from opacus.accountants.utils import get_noise_multiplier

    with warnings.catch_warnings():  # (its search tries tiny sigmas, whose best RDP order is the largest)
        warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
        return get_noise_multiplier(target_epsilon=target_epsilon, target_delta=delta, sample_rate=q, steps=steps,
                                    accountant=ACCOUNTANT, epsilon_tolerance=0.01)


@functools.lru_cache(maxsize=64)
def _one_step_rdp(noise_multiplier: float, sample_rate: float):
    """The RDP of one sampled Gaussian step at each of Opacus's orders: (len(orders),)."""
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis import rdp as analysis

    return analysis.compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier, steps=1,
                                orders=RDPAccountant.DEFAULT_ALPHAS)


def spent_epsilon(history, delta: float) -> float:
    """Opacus's RDP composition over `history` [(sigma, q, steps)] at `delta`, as RDPAccountant.get_epsilon
    computes it, with each (sigma, q)'s one-step RDP computed once: RDP composes linearly in the steps,
    and computing it afresh (a second per call at q = 1/2) cost more than the training."""
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis import rdp as analysis

    if not history:
        return 0.0
    total = sum(_one_step_rdp(sigma, q) * steps for sigma, q, steps in history)
    with warnings.catch_warnings():  # (the bound holds; at the first steps or a large sigma its best order is
        warnings.filterwarnings("ignore", message="Optimal order is the")  # an end of the range: said once per run)
        eps, _ = analysis.get_privacy_spent(orders=RDPAccountant.DEFAULT_ALPHAS, rdp=total, delta=delta)
    return float(eps)


def check_module(module: torch.nn.Module, architecture: str) -> None:
    """One clear line when per-sample gradients cannot be computed for this discriminator."""
    from opacus.grad_sample import GradSampleModule
    from opacus.validators import ModuleValidator

    errors = ModuleValidator.validate(module, strict=False)
    unsupported = [type(m).__name__ for m in module.modules()
                   if not list(m.children()) and any(p.requires_grad for p in m.parameters(recurse=False))
                   and type(m) not in GradSampleModule.GRAD_SAMPLERS]
    if errors or unsupported:
        why = "; ".join([str(e).splitlines()[0] for e in errors] + [f"{n} has no per-sample gradient in Opacus"
                                                                   for n in sorted(set(unsupported))])
        raise ConfigError(f"DP-SGD cannot train the discriminator of {named('architecture')} {architecture}: {why}; "
                          f"use {named('architecture')} mlp")


def check_run(config, shard_sizes: list[int]) -> None:
    """Every site's DP settings resolvable and its D trainable with per-sample gradients: one clear
    line for the first that is not, before a run starts (each worker checks its own again)."""
    from mdgan.models import build_discriminator

    if config.privacy.mechanism == "sgd":  # (private feedback trains its discriminators without per-sample gradients)
        check_module(build_discriminator(config.model, 0), config.model.architecture)
    for size in shard_sizes:
        resolve(config.privacy, size, config.batch_size, config.iterations, config.disc_steps)


class PrivateSteps:
    """DP-SGD for one discriminator: Poisson sampling, per-sample clipping, noise, and the accountant.

    `real_step(real_loss_per_sample)` is called with a function that computes the per-sample losses of
    the sampled real images; it leaves the clipped, noised and scaled gradient in every parameter's
    .grad. The caller then adds the generated part's gradient and steps the (wrapped) Adam.
    """

    def __init__(self, discriminator: torch.nn.Module, optimizer: torch.optim.Optimizer, site: SitePrivacy,
                 batch_size: int, ledger: PrivacyLedger):
        from opacus.grad_sample import GradSampleModuleFastGradientClipping
        from opacus.optimizers import DPOptimizerFastGradientClipping

        self.site = site
        self.batch_size = batch_size
        # hooks on D's own layers: while enabled, a backward pass records each sample's gradient norm
        # (ghost clipping: from the layers' inputs and output gradients, no per-sample gradient made)
        self.module = GradSampleModuleFastGradientClipping(discriminator, batch_first=True, loss_reduction="sum",
                                                           max_grad_norm=site.max_grad_norm, use_ghost_clipping=True)
        self.module.disable_hooks()
        self.ledger = ledger
        self.noise = ledger.secret.stream("dp-sgd/noise")  # draw i: step i's noise, all of D's weights at once
        self.sampling = ledger.secret.stream("dp-sgd/sampling")  # draw i: step i's Poisson sample
        self.optimizer = DPOptimizerFastGradientClipping(
            optimizer, noise_multiplier=site.noise_multiplier, max_grad_norm=site.max_grad_norm,
            expected_batch_size=batch_size, loss_reduction="mean")

    def sample(self, shard_size: int) -> torch.Tensor:
        """Poisson sampling: each index in with probability q (the batch size varies, may be 0): (n,)."""
        u = self.sampling.uniform(self.ledger.steps_taken, shard_size)
        return torch.nonzero(u < self.site.sample_rate).flatten()

    def real_step(self, parameters: list[torch.nn.Parameter], per_sample_losses) -> None:
        """The real part's per-sample gradients clipped to C, summed, noised and divided by b, into .grad.

        Opacus's ghost clipping: a first backward pass records each sample's gradient norm, a second one
        of the losses weighted by min(1, C / norm) gives the sum of the clipped gradients; its
        DPOptimizerFastGradientClipping adds N(0, (sigma C)^2) and divides by b."""
        clipped = self._clipped_losses(per_sample_losses)
        self.optimizer.zero_grad(set_to_none=True)
        if clipped is not None:
            clipped.sum().backward()
        for p in parameters:
            if p.grad is None:  # an empty Poisson sample: no gradient, the noise alone
                p.grad = torch.zeros_like(p)
        self._add_noise()  # sum, add N(0, (sigma C)^2), divide by b
        for p in parameters:  # the generated part's gradient is added to .grad from here on
            p.summed_grad = None
        self.ledger.count_step(self.site.noise_multiplier, self.site.sample_rate)

    def generated_step(self, parameters: list[torch.nn.Parameter], per_sample_losses) -> None:
        """The generated part's per-sample gradients clipped to C, summed and divided by b, added to .grad (which
        holds the real part's): no noise, since generated samples are public (--dp-clip-generated).

        Ghost clipping as in `real_step`; the real part's gradient is held aside meanwhile."""
        held = [p.grad for p in parameters]
        for p in parameters:
            p.grad = None
        clipped = self._clipped_losses(per_sample_losses)
        for p in parameters:
            p.grad = None
        if clipped is not None:
            (clipped.sum() / self.batch_size).backward()
        for p, real in zip(parameters, held):
            p.grad = real if p.grad is None else real + p.grad

    def _clipped_losses(self, per_sample_losses) -> torch.Tensor | None:
        """Ghost clipping's first pass: the per-sample losses weighted by min(1, C / the norm of each one's
        gradient), (n,), whose sum's gradient is the sum of the clipped gradients; None for no samples. The
        pass leaves the unclipped sum in .grad: the caller clears it."""
        self.module.enable_hooks()
        try:
            losses = per_sample_losses()  # (n,)
            if losses is None or not losses.numel():
                return None
            losses.sum().backward(retain_graph=True)
            return losses * self.module.get_clipping_coef().detach()
        finally:
            self.module.disable_hooks()

    def _add_noise(self) -> None:
        """DPOptimizer's accumulate, noise and scale, the noise drawn from the site's secret stream on the CPU (the
        same numbers on any device) at the index of this step."""
        self.optimizer.accumulate()
        params = self.optimizer.params
        sigma_c = self.site.noise_multiplier * self.site.max_grad_norm
        noise = self.noise.normal(self.ledger.steps_taken, sum(p.numel() for p in params), sigma_c)  # (P,) float64
        for p, drawn in zip(params, torch.split(noise, [p.numel() for p in params])):
            drawn = drawn.to(p.summed_grad.dtype).view_as(p.summed_grad).to(p.device)
            p.grad = ((p.summed_grad + drawn) / self.batch_size).view_as(p)

    def step(self) -> None:
        self.optimizer.original_optimizer.step()

    def epsilon(self) -> float:
        """What the ledger's steps spend at the site's delta (RDPAccountant.get_epsilon's number)."""
        return spent_epsilon(self.ledger.history(), self.site.delta)

    def epsilon_after(self, more_steps: int) -> float:
        """The epsilon this site would have spent after `more_steps` more steps (its budget's check)."""
        site = self.site
        return spent_epsilon([*self.ledger.history(), (site.noise_multiplier, site.sample_rate, more_steps)],
                             site.delta)

    def epsilon_after_iteration(self) -> float:
        """The epsilon after one more MD-GAN iteration's L steps."""
        return self.epsilon_after(self.site.steps_per_iteration)
