"""Partial synchronisation: how long one iteration waits for the workers' feedback.

The paper's protocol (`--sync all`, the default: iterations.py's Synchronous) waits for every
worker every iteration, so the slowest worker sets the pace. The coordinator design proceeds once a
threshold of workers answered; FedBuff-style training goes further and applies what arrives.

- quorum K: G is updated once K workers answered the current iteration (or every worker that got
  its batches answered or failed). The others keep computing; their answer, when it comes, is late:
  dropped and counted (`late` in the iteration's record). A worker still computing gets no new
  batches until it answered, so a straggler costs no queue. With K = N this is `all`, bit for bit.
- async: every iteration sends fresh batches (from the current G) to the workers that are idle,
  waits until at least one answer is in, and applies every answer in: feedback computed on batches of
  iteration t0 < t (staleness s = t - t0) is pushed through G(z) of the *current* G with the same
  noise z (the old graph is gone: Adam changed the weights in place), weighted by 1 / (1 + s), or
  dropped and counted as late when s > --max-staleness.

Neither is deterministic over a network (who is late depends on timing), so only `all` (and
`quorum` with K = N) keeps `mdgan local` == `mdgan simulate`. In one process every worker answers at
once, so quorum and async behave as `all` there, apart from workers that crash.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from mdgan import aggregation
from mdgan.algorithms.base import sort_replies, why_lost, with_deadline
from mdgan.algorithms.mdgan.exchange import Exchanged, IterationStrategy
from mdgan.config import SYNC_MODES  # noqa: F401  (the names, validated with the run's config)
from mdgan.gan import GeneratedBatches, WorkerBatch
from mdgan.step_results import StepResult, read_stats


@dataclass
class Issued:
    """Batches sent to one worker whose answer is not in yet."""

    task: asyncio.Future
    iteration: int
    batches: GeneratedBatches
    batch: WorkerBatch


@dataclass
class Harvest:
    """The answers in at one look, in rank order: `groups` the feedback used, grouped by the batches it
    was computed on ([(Issued, feedback)] each); `stats` their StepResults; the answers rejected, the
    workers lost, and the answers too late to use."""

    groups: list[list] = field(default_factory=list)
    stats: list[StepResult] = field(default_factory=list)
    rejected: int = 0
    lost: int = 0
    late: int = 0

    def add(self, other: "Harvest") -> None:
        self.groups += other.groups
        self.stats += other.stats
        self.rejected += other.rejected
        self.lost += other.lost
        self.late += other.late


def staleness_weight(staleness: int) -> float:
    """async: how much a feedback computed `staleness` iterations ago counts."""
    return 1.0 / (1 + staleness)


class PartialSync(IterationStrategy):
    """The feedback exchange and G update of one iteration under --sync quorum|async.

    Drives a Trainer's workers through the Trainer's own helpers (active workers, drop, swap,
    traffic), so membership, swaps and accounting stay in one place.
    """

    def __init__(self, config):
        self.config = config
        self.mode = config.sync
        self.outstanding: dict[object, Issued] = {}  # worker handle -> its unanswered batches

    async def close(self, trainer, stopped: bool) -> None:
        """The run's end, with answers perhaps still out (a signal, or too few workers): nobody will read them,
        and a step that fails meanwhile (its worker told to stop) must not be logged as an error."""
        for issued in self.outstanding.values():
            issued.task.add_done_callback(lambda task: task.cancelled() or task.exception())
        self.outstanding.clear()

    def _issue(self, trainer, t: int) -> int:
        """Fresh batches for every idle worker; the number of workers that got some."""
        idle = [w for w in trainer.active if w not in self.outstanding and not getattr(w, "needs_copy", False)]
        if not idle:
            return 0
        batches = trainer.generator.generate(min(self.config.kappa, len(idle)))
        for rank, worker in enumerate(idle):
            batch = batches.for_worker(rank)
            task = asyncio.ensure_future(with_deadline(worker.step(t, batch), trainer.step_timeout))
            self.outstanding[worker] = Issued(task, t, batches, batch)
            trainer.count_batch(batch)
        return len(idle)

    def _enough(self, t: int) -> bool:
        issued = [i for i in self.outstanding.values() if i.iteration == t]
        if self.mode == "quorum":
            answered = sum(1 for i in issued if i.task.done() and not i.task.cancelled()
                           and isinstance(i.task.exception() or i.task.result(), StepResult))
            return answered >= min(self.config.quorum_size, len(issued)) or all(i.task.done() for i in issued)
        return any(i.task.done() for i in self.outstanding.values())

    async def _wait(self, t: int) -> None:
        while not self._enough(t):
            pending = [i.task for i in self.outstanding.values() if not i.task.done()]
            if not pending:
                return
            await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)

    async def _harvest(self, trainer, t: int, drain: bool = False) -> Harvest:
        """Every answer in (every one, with `drain`), in rank order."""
        if drain and self.outstanding:
            await asyncio.wait([i.task for i in self.outstanding.values()])
        done = sorted(((w, i) for w, i in self.outstanding.items() if i.task.done()), key=lambda wi: wi[0].shard_index)
        for worker, _ in done:
            del self.outstanding[worker]
        issued_to = dict(done)
        replies = sort_replies([w for w, _ in done], [i.task.exception() or i.task.result() for _, i in done])
        used: dict[int, list] = {}  # id(batches) -> [(Issued, feedback)]
        harvest = Harvest(rejected=len(replies.rejected))
        for worker, reply in replies.good:
            issued = issued_to[worker]
            trainer.count_feedback(reply, worker.worker_id)
            staleness = t - issued.iteration
            if (self.mode == "quorum" and staleness > 0) or staleness > self.config.max_staleness:
                harvest.late += 1
                continue
            used.setdefault(id(issued.batches), []).append((issued, reply.feedback))
            harvest.stats.append(reply)
        for worker, error in replies.lost:
            harvest.lost += await trainer.lose(worker, why_lost(error))
        harvest.groups = list(used.values())
        return harvest

    def _update(self, trainer, t: int, groups: list[list]) -> None:
        generator, cfg = trainer.generator, self.config
        if self.mode == "quorum":  # one set of batches, this iteration's: the arithmetic of --sync all
            (entries,) = groups
            generator.update(entries[0][0].batches, [(i.batch.generated_index, f) for i, f in entries])
            return
        generator.optimizer.zero_grad(set_to_none=True)
        for entries in sorted(groups, key=lambda g: g[0][0].iteration):
            origin, batches = entries[0][0].iteration, entries[0][0].batches
            if origin != t:  # the graph of an older G is gone: the same noise through the current G
                batches = generator.regenerate(batches)
            feedback = [(i.batch.generated_index, f) for i, f in entries]
            incoming = aggregation.combine(batches.samples, feedback, cfg.aggregation, cfg.trim_fraction,
                                           cfg.clip_norm)
            batches.samples.backward(incoming * staleness_weight(t - origin))
        generator.optimizer.step()

    async def exchange(self, trainer, t: int) -> Exchanged:
        """Issue, wait, apply. Under async an iteration is one update of G: while only unusable answers
        came in, the workers that gave them get fresh batches and it waits again."""
        begun = time.perf_counter()
        # answers that came in since the last iteration closed: late (quorum) or stale (async); the
        # workers that gave them are idle again and get this iteration's batches
        harvest = await self._harvest(trainer, t)
        issued, waiting = 0, 0.0
        while True:
            issued += self._issue(trainer, t)
            started = time.perf_counter()
            await self._wait(t)
            harvest.add(await self._harvest(trainer, t))
            waiting += time.perf_counter() - started
            if harvest.groups or self.mode == "quorum" or not self.outstanding:
                break
        updating = time.perf_counter()
        if harvest.groups:
            self._update(trainer, t, harvest.groups)
        if t >= self.config.iterations:  # nothing may stay in flight after the last iteration
            drained = await self._harvest(trainer, t + self.config.max_staleness + 1, drain=True)
            harvest.add(Harvest(rejected=drained.rejected, lost=drained.lost, late=drained.late))
        updated = time.perf_counter()
        stats = read_stats(harvest.stats)
        return Exchanged(issued, stats, harvest.rejected, harvest.lost, harvest.late,
                         generate_seconds=max(0.0, time.perf_counter() - begun - waiting - (updated - updating)),
                         wait_seconds=waiting, update_seconds=updated - updating)
