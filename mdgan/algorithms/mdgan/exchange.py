"""What every way of running one MD-GAN iteration's exchange with the workers implements
(iterations.py picks one per run): the exchange itself, and what it holds between iterations."""

from __future__ import annotations

from dataclasses import dataclass, field

from mdgan.step_results import StepResult


@dataclass
class Exchanged:
    """One iteration's exchange: the workers sent batches, the answers used (their StepResults, read to
    the host), the answers refused, the workers lost, the answers too late to use, and where the time went."""

    issued: int = 0
    stats: list[StepResult] = field(default_factory=list)
    rejected: int = 0
    lost: int = 0
    late: int = 0
    generate_seconds: float = 0.0
    wait_seconds: float = 0.0
    update_seconds: float = 0.0


class IterationStrategy:
    """One iteration's exchange, and what the strategy holds between iterations (nothing, by default)."""

    async def exchange(self, trainer, t: int) -> Exchanged:
        raise NotImplementedError

    async def drain(self) -> None:
        """Before a checkpoint: every answer the strategy holds is in (a checkpoint holds answers, not futures)."""

    async def close(self, trainer, stopped: bool) -> None:
        """The run's end (stopped: early, by a signal or too few workers): nothing left in flight."""

    def state(self) -> dict:
        """What a checkpoint keeps of the strategy, merged into the Trainer's state."""
        return {}

    def restore(self, state: dict, generator) -> None:
        """The strategy as `state` (a Trainer's state) left it; generator: the run's GeneratorSide."""
