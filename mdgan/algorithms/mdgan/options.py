"""MD-GAN's own options: flags of simulate, local, experiments and mdgan-server, made from these
fields (mdgan/algorithms/base.py `option`). The server sends the swap check to its workers (a worker's
own --swap-check overrides it: a site decides what it installs); the swap lag and the pipeline depth
are the server's alone (when each round's discriminators are installed, trainer.py; which iteration's
feedback moves G, pipeline.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mdgan.algorithms.base import option
from mdgan.algorithms.mdgan.swapcheck import SWAP_CHECKS, SwapCheck
from mdgan.config import ConfigError, TrainingConfig, named


@dataclass(frozen=True)
class MDGANOptions:
    swap_check: str = option("on", "--swap-check", "check a received discriminator before it replaces ours "
                             "(norm and loss on our own data; docs/PRIVACY.md): on or off", choices=SWAP_CHECKS,
                             short="swapcheck")
    swap_check_norm_ratio: float = option(SwapCheck.norm_ratio, "--swap-check-norm-ratio",
                                          "refuse a discriminator whose weights' norm is beyond this factor of ours")
    swap_check_loss_ratio: float = option(SwapCheck.loss_ratio, "--swap-check-loss-ratio",
                                          "refuse a discriminator whose loss on our check set exceeds this times "
                                          "max(ours, an all-zero D's)")
    swap_check_min_cosine: float = option(SwapCheck.min_cosine, "--swap-check-min-cosine",
                                          "refuse a discriminator whose weights make an angle with ours whose cosine "
                                          "is below this (sign-flipped: -1; random: about 0)")
    swap_lag: int = option(0, "--swap-lag", "background swaps: the discriminators snapshotted at a swap boundary t "
                           "travel while training goes on and are installed at boundary t + LAG (waiting there only "
                           "for one not yet arrived); 0: the paper's swap, a barrier at t; below the swap period "
                           "(docs/WIDE_AREA.md)", short="lag")
    pipeline_depth: int = option(0, "--pipeline-depth", "keep D iterations of batches in flight: G's update at "
                                 "iteration t uses the feedback on the batches of iteration t - D, their noise "
                                 "through the current G (deterministic: local == simulate at any depth); 0: the "
                                 "paper's round trip every iteration (docs/WIDE_AREA.md)", short="depth")

    def as_check(self) -> SwapCheck:
        return SwapCheck(self.swap_check == "on", self.swap_check_norm_ratio, self.swap_check_loss_ratio,
                         self.swap_check_min_cosine).validate()

    def validate(self) -> "MDGANOptions":
        if self.swap_check not in SWAP_CHECKS:
            raise ConfigError(f"{named('swap_check')} must be one of {SWAP_CHECKS}, got {self.swap_check!r}")
        if isinstance(self.swap_lag, bool) or not isinstance(self.swap_lag, int) or self.swap_lag < 0:
            raise ConfigError(f"{named('swap_lag')} must be a whole number of iterations >= 0, got {self.swap_lag!r}")
        depth = self.pipeline_depth
        if isinstance(depth, bool) or not isinstance(depth, int) or not 0 <= depth <= MAX_PIPELINE_DEPTH:
            raise ConfigError(f"{named('pipeline_depth')} must be a whole number of iterations from 0 to "
                              f"{MAX_PIPELINE_DEPTH}, got {depth!r}")
        self.as_check()
        return self

    def check(self, config: TrainingConfig) -> "MDGANOptions":
        """Against the run: a lag must end before the next swap boundary (known here when --swap-every
        fixes the period; otherwise when the shards are, trainer.py)."""
        self.validate()
        if self.pipeline_depth and config.sync != "all":
            raise ConfigError(f"{named('pipeline_depth')} {self.pipeline_depth} needs {named('sync')} all: a pipeline of fixed depth "
                              f"waits for every worker's answer, D iterations later ({named('sync')} {config.sync} does not)")
        if self.pipeline_depth and self.pipeline_depth >= config.iterations:
            raise ConfigError(f"{named('pipeline_depth')} {self.pipeline_depth} must be below {named('iterations')} "
                              f"{config.iterations} (G is first updated at iteration D + 1)")
        if self.swap_lag and config.privacy.keeps_discriminators:
            raise ConfigError(f"{named('swap_lag')} {self.swap_lag}: with {named('dp_mechanism')} feedback no discriminator leaves its "
                              f"site, so there are no swaps to lag (leave {named('swap_lag')} out)")
        if self.swap_lag and config.swap_every is not None:
            check_lag(self.swap_lag, config.swap_every)
        return self

    def summary(self, config: TrainingConfig) -> dict:
        return dataclasses.asdict(self)


MAX_PIPELINE_DEPTH = 64  # the server keeps D iterations of batches, and their feedback, in memory


def check_lag(lag: int, swap_period: int | None) -> None:
    """One round in flight at a time: its discriminators are installed before the next round's snapshot.
    (swap_period None: no rounds; a lag there is refused with the mechanism, mdgan/config.py)"""
    if swap_period is not None and lag >= swap_period:
        raise ConfigError(f"{named('swap_lag')} {lag} must be below the swap period S = {swap_period} iterations "
                          "(a round's discriminators are installed before the next round starts)")
