"""How one MD-GAN iteration exchanges batches and feedback with the workers, chosen once per run.

The Trainer (trainer.py) only wires an iteration: its strategy's exchange, then the boundary's
swaps, then the record. The strategies:

- Synchronous (`--sync all`, the paper): every member gets batches of the current G; G is updated
  with every answer, in rank order, once all are in (or failed).
- PartialSync (`--sync quorum|async`, synchrony.py): G is updated once some of the answers are in.
- Pipeline (`--pipeline-depth D`, pipeline.py): iteration t sends its batches and updates G with the
  feedback on the batches of t - D.

Each is an IterationStrategy (exchange.py) and returns an Exchanged.

`iteration_strategy(config, pipeline_depth)` picks one; the options refuse depth > 0 with a sync
other than all.
"""

from __future__ import annotations

import logging
import time

from mdgan.algorithms.base import ask_all, why_lost
from mdgan.algorithms.mdgan.exchange import Exchanged, IterationStrategy
from mdgan.algorithms.mdgan.pipeline import Pipeline
from mdgan.algorithms.mdgan.synchrony import PartialSync
from mdgan.config import TrainingConfig
from mdgan.step_results import start_reading

log = logging.getLogger("mdgan.algorithms.mdgan.trainer")  # (the training loop's lines, one logger)


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


def iteration_strategy(config: TrainingConfig, pipeline_depth: int = 0) -> IterationStrategy:
    """The run's iteration: partial synchronisation, a pipeline of fixed depth, or the paper's."""
    if config.sync != "all":
        return PartialSync(config)
    if pipeline_depth:
        return Pipeline(pipeline_depth)
    return Synchronous()
