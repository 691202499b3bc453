"""Emulated Byzantine workers: what a worker that sends wrong feedback sends instead of F_n.

For experiments and tests of the robust aggregation rules (mdgan/aggregation.py) only. The worker
still trains its discriminator as usual; just the feedback it sends is replaced:

- sign-flip: -F_n (pushes G away from what the discriminators want);
- scale: SCALE_FACTOR x F_n (one loud worker dominates a mean);
- sign-flip-scale: -SCALE_FACTOR x F_n (both at once: a minority of flippers turns the mean around.
  A plain minority flip only shrinks the mean, same direction, which Adam's scale-free step ignores;
  two of ten sending -10 F make the mean about -1.2 times the honest one);
- noise: Gaussian noise with NOISE_FACTOR times F_n's RMS (no information, a lot of energy);
- free-ride: zeros (a worker that takes part without doing the work).

The swap attacks keep the feedback honest and replace the discriminator the worker pushes to its peer
at each swap (what the receiver's check, mdgan/algorithms/mdgan/swapcheck.py, must refuse):

- swap-zero: every weight 0;
- swap-sign-flip: every weight negated;
- swap-scale: every weight times SCALE_FACTOR;
- swap-random: Gaussian weights (standard normal, seeded), nothing learnt.

`mdgan simulate --byzantine K --attack A` makes the last K workers by rank attackers; over gRPC the
same worker runs `mdgan-worker --attack A` (`mdgan local --byzantine K --attack A` does that), with
the same seeded noise, so both transports still end with the same generator.
"""

from __future__ import annotations

import torch

from mdgan.config import ConfigError, named
from mdgan.gan import derive_seed

FEEDBACK_ATTACKS = ("sign-flip", "scale", "sign-flip-scale", "noise", "free-ride")
SWAP_ATTACKS = ("swap-zero", "swap-sign-flip", "swap-scale", "swap-random")
ATTACKS = FEEDBACK_ATTACKS + SWAP_ATTACKS
SCALE_FACTOR = 10.0
NOISE_FACTOR = 10.0


class FeedbackAttack:
    """Replaces a worker's feedback; the noise is seeded by (run seed, shard index)."""

    def __init__(self, kind: str, run_seed: int = 0, shard_index: int = 0):
        if kind not in ATTACKS:
            raise ConfigError(f"unknown attack {kind!r}; choose from {ATTACKS}")
        self.kind = kind
        self._noise = torch.Generator().manual_seed(derive_seed(run_seed, "attack", shard_index))

    def __call__(self, feedback: torch.Tensor) -> torch.Tensor:
        if self.kind in SWAP_ATTACKS:  # honest feedback; the discriminator it pushes is the attack
            return feedback
        if self.kind == "sign-flip":
            return -feedback
        if self.kind == "scale":
            return feedback * SCALE_FACTOR
        if self.kind == "sign-flip-scale":
            return feedback * -SCALE_FACTOR
        if self.kind == "free-ride":
            return torch.zeros_like(feedback)
        rms = feedback.detach().cpu().pow(2).mean().sqrt()
        noise = torch.randn(feedback.shape, generator=self._noise)  # drawn on the CPU: the same on any device
        return (noise * (NOISE_FACTOR * rms)).to(feedback.device, feedback.dtype)


class DiscriminatorAttack:
    """Replaces the discriminator state a worker pushes at a swap (SWAP_ATTACKS); seeded by (run seed, shard)."""

    def __init__(self, kind: str, run_seed: int = 0, shard_index: int = 0):
        if kind not in SWAP_ATTACKS:
            raise ConfigError(f"unknown swap attack {kind!r}; choose from {SWAP_ATTACKS}")
        self.kind = kind
        self._noise = torch.Generator().manual_seed(derive_seed(run_seed, "swap-attack", shard_index))

    def __call__(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in state.items():
            if not t.is_floating_point():
                out[name] = t
            elif self.kind == "swap-zero":
                out[name] = torch.zeros_like(t)
            elif self.kind == "swap-sign-flip":
                out[name] = -t
            elif self.kind == "swap-scale":
                out[name] = t * SCALE_FACTOR
            else:
                out[name] = torch.randn(t.shape, generator=self._noise).to(t.device, t.dtype)
        return out


def make_attacks(kind: str | None, run_seed: int, shard_index: int):
    """(feedback attack or None, discriminator attack or None) of an emulated Byzantine worker."""
    if kind is None:
        return None, None
    if kind in SWAP_ATTACKS:
        return None, DiscriminatorAttack(kind, run_seed, shard_index)
    return FeedbackAttack(kind, run_seed, shard_index), None


def attackers(workers: int, byzantine: int) -> range:
    """The shard indices of the emulated attackers: the last `byzantine` by rank."""
    if not 0 <= byzantine < workers:
        raise ConfigError(f"{named('byzantine')} must be in [0, workers={workers}), got {byzantine}")
    return range(workers - byzantine, workers)
