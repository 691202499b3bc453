"""MD-GAN: a received discriminator is checked before it replaces the receiver's own.

Mutual TLS keeps outsiders out, but a member (a malicious site, or one whose key was stolen) can push
whatever it likes to the peer the server designated for it: a zeroed, sign-flipped, scaled or random
discriminator would then train against the generator's samples, and its feedback would steer G.
The receiver therefore compares the incoming D with its own on data it already holds, and keeps
its own for the round when the incoming one is

- not finite (a NaN or an infinity anywhere in the state);
- pointing elsewhere: the cosine of the angle between its weights and the receiver's (each D's
  weights as one vector) below `min_cosine`. Honest discriminators descend from one initialisation and
  are mixed by the swaps; a sign-flipped one has cosine -1, a random one about 0;
- of another size: the L2 norm of its weights more than `norm_ratio` times larger or smaller than
  the norm of the receiver's own (every D starts from the same initialisation and trains at the same
  learning rate, so honest ones stay within a small factor: docs/PRIVACY.md measures it);
- worse than knowing nothing: its discriminator loss (as it trains: source and class terms) on the
  check set exceeds `loss_ratio` times the larger of the receiver's own D's loss and the loss of a D
  that outputs zeros. Sign-flipped and random discriminators fail here.

The check set: the first `samples` real images of the receiver's shard (fixed: no random draw, so
nothing in the run changes when every check passes) and the generated samples of the last batch it
trained on (the round's X_d). Both D are evaluated in eval mode, on a scratch copy of the module: the
receiver's own D and its optimizer are untouched. The check is part of MD-GAN's swap on every transport
(the in-process run and the services call this same function with the same inputs), so a refusal
keeps `mdgan local == mdgan simulate` bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mdgan.config import ConfigError, named
from mdgan.gan import DiscriminatorSide

SWAP_CHECKS = ("on", "off")


@dataclass(frozen=True)
class SwapCheck:
    """How a receiver judges an incoming discriminator (mdgan-worker --swap-check, ...)."""

    enabled: bool = True
    norm_ratio: float = 4.0  # refuse beyond this factor, up or down, of the own D's weight norm
    loss_ratio: float = 2.0  # refuse a check-set loss above this times max(own D's, an all-zero D's)
    min_cosine: float = 0.25  # refuse weights pointing elsewhere than ours: cosine of the angle below this
    samples: int = 64  # real images of the shard in the check set (the first ones)

    def validate(self) -> "SwapCheck":
        if not (math.isfinite(self.norm_ratio) and self.norm_ratio > 1):
            raise ConfigError(f"{named('swap_check_norm_ratio')} must be a number > 1, got {self.norm_ratio}")
        if not (math.isfinite(self.loss_ratio) and self.loss_ratio >= 1):
            raise ConfigError(f"{named('swap_check_loss_ratio')} must be a number >= 1, got {self.loss_ratio}")
        if not (math.isfinite(self.min_cosine) and -1 <= self.min_cosine <= 1):
            raise ConfigError(f"{named('swap_check_min_cosine')} must be in [-1, 1], got {self.min_cosine}")
        if self.samples < 1:
            raise ConfigError(f"--swap-check-samples must be at least 1, got {self.samples}")
        return self


@dataclass(frozen=True)
class Verdict:
    """What the check found; `refused` is the reason, empty when the incoming D is accepted."""

    refused: str
    norm_ratio: float
    loss: float  # the incoming D's loss on the check set
    own_loss: float
    zero_loss: float  # the loss of a D that outputs zeros (knows nothing)
    cosine: float = math.nan  # cosine of the angle between its weights and ours (one vector each)


def _flat(state: dict[str, torch.Tensor], names) -> torch.Tensor:
    """D's floating-point state as one float64 vector (all weights, in the module's order)."""
    return torch.cat([state[n].detach().reshape(-1).cpu().double() for n in names if state[n].is_floating_point()])


def _check_set(side: DiscriminatorSide, samples: int):
    """(real, real labels, generated, generated labels), any of them None. A private site (DP-SGD) judges
    on generated samples only: a verdict computed on its real images would be a release the accountant
    does not count."""
    real = real_labels = None
    if side.private is None:
        shard = side.sampler.shard
        real = shard.images[:samples].to(side.device)  # (n, *shape)
        real_labels = shard.labels[:samples].to(side.device)  # (n,)
    fake, fake_labels = side.last_discriminated if side.last_discriminated is not None else (None, None)
    return real, real_labels, fake, fake_labels


def _half_loss(spec, logits: torch.Tensor, labels: torch.Tensor | None, target: float) -> torch.Tensor:
    """One half of the discriminator's loss: real (target 1) or generated (target 0) samples."""
    loss = F.binary_cross_entropy_with_logits(logits[:, 0], torch.full_like(logits[:, 0], target))
    if spec.conditional:
        loss = loss + F.cross_entropy(logits[:, 1:], labels)
    return loss


def _loss(side: DiscriminatorSide, module: torch.nn.Module | None, check_set) -> float:
    """D's loss on the check set (module None: a D that outputs zeros); nan when the set is empty."""
    real, real_labels, fake, fake_labels = check_set
    spec = side.spec
    outputs = 1 + (spec.num_classes if spec.conditional else 0)
    loss = torch.zeros(())
    with torch.no_grad():
        for samples, labels, target in ((real, real_labels, 1.0), (fake, fake_labels, 0.0)):
            if samples is None:
                continue
            logits = samples.new_zeros(len(samples), outputs) if module is None else module(samples)
            loss = loss + _half_loss(spec, logits, labels, target).cpu()
    if real is None and fake is None:
        return math.nan
    return float(loss)


def check_incoming(side: DiscriminatorSide, state: dict[str, torch.Tensor], check: SwapCheck) -> Verdict:
    """Whether `state` (a peer's D, as it arrived) may replace side's own discriminator."""
    names = list(side.discriminator.state_dict())
    for name in names:
        t = state[name]
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return Verdict(f"its {name} is not finite", math.nan, math.nan, math.nan, math.nan)
    own_state = side.discriminator.state_dict()
    own_vector, vector = _flat(own_state, names), _flat(state, names)
    own_norm, norm = float(own_vector.norm()), float(vector.norm())
    ratio = norm / own_norm if own_norm > 0 else math.inf
    cosine = float(own_vector @ vector) / (own_norm * norm) if own_norm > 0 and norm > 0 else 0.0
    scratch = side.check_module()
    check_set = _check_set(side, check.samples)
    scratch.load_state_dict(own_state)
    own_loss = _loss(side, scratch, check_set)
    scratch.load_state_dict({n: state[n] for n in names})
    loss = _loss(side, scratch, check_set)
    zero_loss = _loss(side, None, check_set)
    refused = ""
    if not (1 / check.norm_ratio <= ratio <= check.norm_ratio):
        refused = (f"its weights' norm is {ratio:.3g} times ours (allowed: 1/{check.norm_ratio:g} to "
                   f"{check.norm_ratio:g})")
    elif not cosine >= check.min_cosine:
        refused = (f"its weights point away from ours: cosine {cosine:.3g}, below {check.min_cosine:g} "
                   "(sign-flipped: -1, random: about 0)")
        if cosine > 0 and loss <= check.loss_ratio * max(own_loss, zero_loss):
            # the one refusal an honest D can earn: at a high learning rate (the paper's MD-GAN Adam setting,
            # D at 4e-3) discriminators drift apart within a swap period (docs/PRIVACY.md measures it)
            refused += ("; it passes the loss check: if honest discriminators are refused this way, they have "
                        "drifted apart (a high learning rate?): lower --swap-check-min-cosine")
    elif (check_set[0] is not None or check_set[2] is not None) \
            and not loss <= check.loss_ratio * max(own_loss, zero_loss):  # (an empty check set: nothing to judge)
        refused = (f"its loss on our check set is {loss:.4g}, more than {check.loss_ratio:g} x max(our D's "
                   f"{own_loss:.4g}, an all-zero D's {zero_loss:.4g})")
    return Verdict(refused, ratio, loss, own_loss, zero_loss, cosine)

