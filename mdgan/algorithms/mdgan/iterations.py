"""How one MD-GAN iteration exchanges batches and feedback with the workers, chosen once per run.

The Trainer (trainer.py) only wires an iteration: its strategy's exchange, then the boundary's
swaps, then the record. The strategies:

- Synchronous (`--sync all`, the paper): every member gets batches of the current G; G is updated
  with every answer, in rank order, once all are in (or failed).
- Partial (`--sync quorum|async`, synchrony.py): G is updated once some of the answers are in.
- Pipelined (`--pipeline-depth D`, pipeline.py): iteration t sends its batches and updates G with the
  feedback on the batches of t - D.

`iteration_strategy(config, pipeline_depth)` picks one; the options refuse depth > 0 with a sync
other than all.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from mdgan.algorithms.base import ask_all, why_lost
from mdgan.algorithms.mdgan.pipeline import Pipeline
from mdgan.algorithms.mdgan.synchrony import PartialSync
from mdgan.config import TrainingConfig
from mdgan.step_results import StepResult, read_stats, start_reading

log = logging.getLogger("mdgan.algorithms.mdgan.trainer")  # (the training loop's lines, one logger)


@dataclass
class Exchanged:
    """One iteration's exchange: the workers sent batches, the answers used (their StepResults, read to
    the host), the answers refused, the workers lost, the answers too late to use, and where the time went."""

    issued: int
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


class Synchronous(IterationStrategy):
    """--sync all: the paper's iteration."""

    async def exchange(self, trainer, t: int) -> Exchanged:
        started = time.perf_counter()
        active = [w for w in trainer.roster.members() if not w.needs_copy]
        batches = trainer.generator.generate(min(trainer.config.kappa, len(active)))
        sent = [batches.for_worker(rank) for rank in range(len(active))]
        generated = time.perf_counter()
        batch_of = dict(zip(active, sent))
        replies = await ask_all(active, lambda w: w.step(t, batch_of[w]), trainer.step_timeout)
        answered = time.perf_counter()
        for batch in sent:
            trainer.count_batch(batch)
        feedback, lost = [], 0
        reading = start_reading(replies.answers)  # (read once G's update is queued: the GPU works on it meanwhile)
        for worker, reply in replies.good:
            trainer.count_feedback(reply, worker.worker_id)
            feedback.append((batch_of[worker].generated_index, reply.feedback))
        for worker, why in replies.rejected:
            log.warning("iteration %d: %s rejected (%s)", t, worker.worker_id, why)
        for worker, error in replies.lost:
            lost += await trainer.lose(worker, why_lost(error))
        if feedback:  # rank order: the order of `active`
            trainer.generator.update(batches, feedback)
        stats = reading.result()
        return Exchanged(len(active), stats, len(replies.rejected), lost, generate_seconds=generated - started,
                         wait_seconds=answered - generated, update_seconds=time.perf_counter() - answered)


class Partial(IterationStrategy):
    """--sync quorum|async (synchrony.py): wait for some of the workers, not all."""

    def __init__(self, config: TrainingConfig):
        self.sync = PartialSync(config)

    async def exchange(self, trainer, t: int) -> Exchanged:
        started = time.perf_counter()
        exchange = await self.sync.exchange(trainer, t)
        harvest = exchange.harvest
        stats = read_stats(harvest.stats)
        return Exchanged(exchange.issued, stats, harvest.rejected, harvest.lost, harvest.late,
                         generate_seconds=max(0.0, time.perf_counter() - started - exchange.waiting - exchange.updating),
                         wait_seconds=exchange.waiting, update_seconds=exchange.updating)

    async def close(self, trainer, stopped: bool) -> None:
        self.sync.abandon()


class Pipelined(IterationStrategy):
    """--pipeline-depth D (pipeline.py): send the batches of t, update G with the feedback on those of t - D."""

    def __init__(self, depth: int):
        self.pipeline = Pipeline(depth)

    async def exchange(self, trainer, t: int) -> Exchanged:
        started = time.perf_counter()
        active = [w for w in trainer.roster.members() if not w.needs_copy]
        lost = await self.pipeline.send(trainer, t, active)
        sent = time.perf_counter()
        used = await self.pipeline.use(trainer, t)
        stats = read_stats(used.stats)
        return Exchanged(len(active), stats, used.rejected, lost + used.lost, generate_seconds=sent - started,
                         wait_seconds=used.waiting, update_seconds=used.updating)

    async def drain(self) -> None:
        await self.pipeline.drain()

    async def close(self, trainer, stopped: bool) -> None:
        if stopped:
            self.pipeline.abandon()
        else:  # the feedback on the last D iterations' batches moves no G
            await self.pipeline.finish(trainer)

    def state(self) -> dict:
        return {"pipeline": self.pipeline.state_dict()}

    def restore(self, state: dict, generator) -> None:
        if "pipeline" not in state:
            raise ValueError("this checkpoint was written without --pipeline-depth: resume it with the depth "
                             "it was started with")
        self.pipeline.load_state_dict(state["pipeline"], generator.device)


def iteration_strategy(config: TrainingConfig, pipeline_depth: int = 0) -> IterationStrategy:
    """The run's iteration: partial synchronisation, a pipeline of fixed depth, or the paper's."""
    if config.sync != "all":
        return Partial(config)
    if pipeline_depth:
        return Pipelined(pipeline_depth)
    return Synchronous()
