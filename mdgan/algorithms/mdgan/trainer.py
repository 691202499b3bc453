"""The MD-GAN training loop, written once over an abstract worker handle.

``Trainer`` drives global iterations against ``WorkerHandle`` objects. ``InProcessWorker``
(inprocess.py) is a handle over a DiscriminatorSide in this process; the gRPC server provides a handle
over a stream (services/server/algorithms/mdgan.py). Both run this same loop, so both end with the
same generator, bit for bit.
"""

from __future__ import annotations

import abc
import asyncio
import math
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from mdgan import compression
from mdgan.algorithms.base import (RUN_FINISHED, IterationRecord, RunResult, Traffic, WorkerLost, ask_all,
                                   last_iteration, mean, sort_replies, tell_to_stop, why_lost, with_deadline)
from mdgan.algorithms.mdgan.options import check_lag
from mdgan.algorithms.mdgan.synchrony import PartialSync
from mdgan.config import TrainingConfig
from mdgan.gan import GeneratorSide, StepResult, WorkerBatch, derangement, read_stats
from mdgan.roster import Roster

log = logging.getLogger(__name__)


SWAP, COPY = "swap", "copy"


@dataclass(frozen=True)
class SwapOrder:
    """A swap (send yours to send_to, take receive_from's), or a one-way copy to a late joiner
    (kind COPY: the donor has only send_to, the joiner only receive_from; round = the boundary's
    iteration, or above it for a copy tried again: each attempt has a number of its own)."""

    swap_round: int
    send_to: str  # worker id that receives this worker's discriminator ("" : send nothing)
    receive_from: str  # worker id whose discriminator this worker takes ("" : take nothing)
    kind: str = SWAP


@dataclass(frozen=True)
class SwapReport:
    swap_round: int
    sent: bool
    received: bool
    sent_bytes: int  # payload: tensor bytes of the discriminator state sent to the peer
    error: str = ""
    refused: str = ""  # the receiver's check refused the incoming D (swapcheck.py): why; it kept its own


class WorkerHandle(abc.ABC):
    """What the training loop sees of a worker, wherever it runs."""

    worker_id: str
    shard_index: int  # fixes the worker's rank order
    shard_size: int  # m

    @abc.abstractmethod
    async def step(self, iteration: int, batch: WorkerBatch) -> StepResult:
        """Send (X_g, X_d), get F_n back. Raises WorkerLost or InputRejected."""

    @abc.abstractmethod
    async def swap(self, order: SwapOrder) -> SwapReport:
        """Send this worker's D to order.send_to and install the one from order.receive_from."""

    async def send_swap(self, order: SwapOrder) -> None:
        """A background swap (--swap-lag > 0), first half: snapshot this worker's D now and send it to
        order.send_to while training goes on; returns at once. Raises WorkerLost."""
        raise NotImplementedError(f"{type(self).__name__} does not swap in the background")

    async def install_swap(self, order: SwapOrder) -> SwapReport:
        """Its second half, `lag` iterations later: install the D from order.receive_from (waiting for it
        if it has not arrived, within the swap deadline) and report the round, as swap() does."""
        raise NotImplementedError(f"{type(self).__name__} does not swap in the background")

    @abc.abstractmethod
    async def cancel_swap(self, swap_round: int, sender: str, reason: str, kind: str = SWAP) -> None:
        """`sender` left during the swap round (or the copy, kind COPY): stop waiting for its discriminator."""

    async def cancel_push(self, swap_round: int, receiver: str, reason: str) -> None:
        """`receiver`, to whom this worker pushes its discriminator in the swap round, left: stop pushing
        (a push retries an unreachable peer until the swap deadline). In one process a push never waits."""

    @abc.abstractmethod
    async def stop(self, reason: str) -> None:
        """The run is over (or this worker is dropped from it)."""

    # A late joiner without usable state of its own waits for a copy of a live peer's D (set by the
    # transport from the roster's RejoinPlan when it admits the worker).
    needs_copy: bool = False

    async def checkpoint(self, iteration: int) -> str | None:
        """Save D, its Adam state and the sampler's state for `iteration` where this worker keeps its
        state; None when written, else why not. Raises WorkerLost."""
        return "this worker keeps no state"


@dataclass
class PendingSwap:
    """A background swap round under way: its discriminators left at boundary `started` and are
    installed at boundary `install_at` (--swap-lag)."""

    swap_round: int
    started: int
    install_at: int
    plan: dict[str, str]  # sender -> receiver
    orders: dict[WorkerHandle, SwapOrder]  # the participants, in rank order
    lost: dict[WorkerHandle, str] = field(default_factory=dict)  # lost while sending: why


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _wire_nbytes(t: torch.Tensor, wire_dtype: str) -> int:
    """Bytes of a float32 tensor as it travels (compressed: values and int8 scales)."""
    return compression.packed_nbytes(tuple(t.shape), wire_dtype)


class Trainer:
    """Runs I global iterations of MD-GAN against worker handles.

    Membership comes from a Roster, asked at each iteration boundary: a worker that arrived since
    the last boundary starts now (after a copy of a live peer's discriminator if it has no state
    of its own), one that left is gone. With `checkpoint_every`, at every such boundary the
    workers save their state and `save_checkpoint(iteration, wrote_all)` saves the server's.
    """

    def __init__(self, config: TrainingConfig, generator: GeneratorSide, workers: list[WorkerHandle] | None = None, *,
                 roster: Roster | None = None, step_timeout: float | None = None, swap_timeout: float | None = None,
                 on_iteration: Callable[[IterationRecord], None] | None = None,
                 on_swap: Callable[[dict], None] | None = None,
                 on_boundary: Callable[[int], None] | None = None,
                 checkpoint_every: int = 0, checkpoint_timeout: float | None = None,
                 save_checkpoint: Callable[[int, bool], None] | None = None, swap_lag: int = 0,
                 stop_after: int | None = None):
        self.config = config
        self.until = last_iteration(config, stop_after)  # (stop_after: no checkpoints; simulate refuses both)
        self.generator = generator
        if roster is None:  # a fixed set of workers, all present from the start
            roster = Roster(config.workers)
            for w in workers or []:
                roster.arrive(w.shard_index, w.worker_id, w)
            roster.at_boundary(0)  # all of them members from the first iteration
            roster.started = True
        self.roster = roster
        self.step_timeout = step_timeout
        self.swap_timeout = swap_timeout
        self.on_iteration = on_iteration
        self.on_swap = on_swap
        self.on_boundary = on_boundary
        self.checkpoint_every = checkpoint_every
        self.checkpoint_timeout = checkpoint_timeout or swap_timeout
        self.save_checkpoint = save_checkpoint
        self.traffic = Traffic()
        self.swaps = 0
        # --swap-lag L: a round's discriminators travel during L iterations (docs/WIDE_AREA.md); 0: a barrier
        self.swap_lag = swap_lag
        self.pending: PendingSwap | None = None  # the background round under way
        self._checkpoint_due = False  # a checkpoint boundary fell inside a background round: taken after it
        # The last copy order's number. A worker's copy mailbox takes each number once, so a copy tried
        # again at the same boundary (its donor left) needs a new one: with the boundary's own number
        # again, the joiner refused every later copy as too old, and the run stood at that boundary.
        self._copy_round = 0
        self._counted_lost: set[WorkerHandle] = set()  # handles whose loss an iteration record counted
        self.rejections = 0
        self.swaps_refused = 0  # discriminators a receiver's check refused (swapcheck.py)
        self.privacy: dict[str, dict] = {}  # DP: worker id -> the (epsilon, delta) it last reported
        self.completed = 0  # iterations done (the boundary the run stands at)
        self.swap_period: int | None = None
        if workers:  # a fixed set: each worker's own m_n is known now (S from the smallest, see swap_period)
            self.swap_period = config.swap_period(min(w.shard_size for w in workers))
            check_lag(swap_lag, self.swap_period)
        self.stop_requested = False  # set by a signal handler: checkpoint at the next boundary and stop
        self._last_checkpoint = 0
        self.checkpoint_started = 0.0  # perf_counter() when the checkpoint under way began
        # --sync quorum|async: the exchange of an iteration lives in mdgan/algorithms/mdgan/synchrony.py
        self.partial = PartialSync(config) if config.sync != "all" else None

    @property
    def active(self) -> list[WorkerHandle]:
        return self.roster.members()

    # -- durable state -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"completed": self.completed, "swaps": self.swaps, "rejections": self.rejections,
                "swaps_refused": self.swaps_refused, "privacy": dict(self.privacy),
                "swap_period": self.swap_period, "payload_bytes": dict(self.traffic.payload_bytes),
                "label_bytes": self.traffic.label_bytes, "roster": self.roster.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.completed = self._last_checkpoint = int(state["completed"])
        self.swaps, self.rejections = int(state["swaps"]), int(state["rejections"])
        self.swaps_refused = int(state.get("swaps_refused", 0))  # (a checkpoint from before the check: none)
        self.privacy = dict(state.get("privacy", {}))
        self.swap_period = int(state["swap_period"])
        self.traffic.payload_bytes.update(state["payload_bytes"])
        self.traffic.label_bytes = int(state["label_bytes"])
        self.roster.load_state_dict(state["roster"], self.completed)

    # -- membership --------------------------------------------------------------------------
    async def wait_to_start(self, timeout: float | None) -> None:
        """Until the start quorum is in: M workers (--min-workers), else all N, or on resume every
        worker alive at the checkpoint (after `timeout`, whoever is in, if at least the quorum)."""
        roster = self.roster
        if not await roster.wait_for(roster.start_quorum, timeout, roster.expected if roster.min_workers is None else None):
            alive = len(roster.alive())
            if roster.expected and alive >= roster.keep_quorum:
                log.warning("resuming with %d workers: not every worker of the checkpoint came back within %.0f s "
                            "(the run goes on, no longer bit for bit the uninterrupted one)", alive, timeout)
            else:
                raise roster.short_of(roster.start_quorum, timeout)
        roster.started = True

    def count_batch(self, batch: WorkerBatch) -> None:
        """Traffic of one worker's batches, as they travel."""
        wire = self.config.wire_dtype
        self.traffic.payload_bytes["server_to_worker"] += (_wire_nbytes(batch.generated, wire)
                                                           + _wire_nbytes(batch.discriminated, wire))
        self.traffic.label_bytes += _nbytes(batch.generated_labels) + _nbytes(batch.discriminated_labels)

    def count_feedback(self, reply: StepResult, worker: WorkerHandle | None = None) -> None:
        self.traffic.payload_bytes["worker_to_server"] += _wire_nbytes(reply.feedback, self.config.wire_dtype)
        if worker is not None and math.isfinite(reply.epsilon):  # DP: what that site says it has spent
            self.privacy[worker.worker_id] = {"epsilon": reply.epsilon, "delta": reply.delta}

    async def _drop(self, worker: WorkerHandle, why: str) -> None:
        if self.roster.depart(worker):
            log.warning("dropping %s: %s", worker.worker_id, why)
            await tell_to_stop(worker, why)

    async def lose(self, worker: WorkerHandle, why: str) -> int:
        """Drop a worker found lost; 1 the first time its loss is seen, 0 after. Under async its step
        can still be out when a swap loses it, and both see the same loss. (The transport may have
        taken it off the roster already: being off the roster does not say it was counted.)"""
        first = worker not in self._counted_lost
        self._counted_lost.add(worker)
        await self._drop(worker, why)
        return int(first)

    async def _pause(self, t: int) -> bool:
        """Fewer than the quorum alive: wait for workers to come back; False when giving up."""
        roster = self.roster
        timeout = roster.pause_timeout
        log.warning("paused after iteration %d: %d workers alive, %d needed; waiting %s", t, len(roster.alive()),
                    roster.keep_quorum, "indefinitely" if timeout is None else f"up to {timeout:.0f} s")
        if not timeout and timeout is not None:
            return len(roster.alive()) >= roster.keep_quorum
        return await roster.wait_for(roster.keep_quorum, timeout)

    async def _admit(self, newcomers: list[WorkerHandle], t: int) -> None:
        """Late joiners that hold no usable state take a copy of a live peer's discriminator (tried
        again at the next boundary if it fails)."""
        donors = [w for w in self.roster.members() if not w.needs_copy]
        for i, joiner in enumerate(newcomers):
            if not donors:
                log.warning("%s joins with a fresh discriminator: no live peer has one to copy", joiner.worker_id)
                joiner.needs_copy = False
                continue
            donor = donors[i % len(donors)]
            self._copy_round = copy_round = max(t, self._copy_round + 1)
            give = SwapOrder(copy_round, joiner.worker_id, "", COPY)
            take = SwapOrder(copy_round, "", donor.worker_id, COPY)
            giving = asyncio.ensure_future(with_deadline(donor.swap(give), self.swap_timeout))
            taking = asyncio.ensure_future(with_deadline(joiner.swap(take), self.swap_timeout))
            gave, = await asyncio.gather(giving, return_exceptions=True)
            # The donor left, or its push failed: nothing will come, and the joiner need not wait out
            # the swap deadline (the run stands still meanwhile).
            why = None
            if isinstance(gave, (WorkerLost, asyncio.TimeoutError)):
                why = why_lost(gave, "deadline")
            elif isinstance(gave, SwapReport) and not gave.sent:
                why = gave.error or "nothing sent"
            if why is not None:
                try:
                    await joiner.cancel_swap(copy_round, donor.worker_id, why, kind=COPY)
                except WorkerLost:
                    pass  # the joiner is gone too: its own report says so
            took, = await asyncio.gather(taking, return_exceptions=True)
            reports = sort_replies((donor, joiner), (gave, took))
            for worker, error in reports.lost:
                await self._drop(worker, why_lost(error, "missed its copy deadline"))
            for _, report in reports.good:
                self.traffic.payload_bytes["worker_to_worker"] += report.sent_bytes
            received = isinstance(took, SwapReport) and took.received
            if received:
                joiner.needs_copy = False
                log.info("%s took a copy of %s's discriminator before iteration %d", joiner.worker_id,
                         donor.worker_id, t + 1)
            elif self.roster.slot_of(joiner) is not None:
                detail = took.error if isinstance(took, SwapReport) else ""
                log.warning("%s: no copy from %s (%s); it waits for the next boundary", joiner.worker_id,
                            donor.worker_id, detail or "donor lost")
            if self.on_swap is not None:
                self.on_swap({"kind": COPY, "iteration": t, "from": donor.worker_id, "to": joiner.worker_id,
                              "received": received})

    # -- one iteration -----------------------------------------------------------------------
    async def iteration(self, t: int) -> IterationRecord:
        if self.partial is not None:
            return await self._partial_iteration(t)
        started = time.perf_counter()
        active = [w for w in self.roster.members() if not w.needs_copy]
        batches = self.generator.generate(min(self.config.kappa, len(active)))
        sent = [batches.for_worker(rank) for rank in range(len(active))]
        generated = time.perf_counter()
        batch_of = dict(zip(active, sent))
        replies = await ask_all(active, lambda w: w.step(t, batch_of[w]), self.step_timeout)
        answered = time.perf_counter()
        for batch in sent:
            self.count_batch(batch)
        feedback, stats, lost = [], read_stats(replies.answers), 0
        for worker, reply in replies.good:
            self.count_feedback(reply, worker)
            feedback.append((batch_of[worker].generated_index, reply.feedback))
        for worker, why in replies.rejected:
            log.warning("iteration %d: %s rejected (%s)", t, worker.worker_id, why)
        for worker, error in replies.lost:
            lost += await self.lose(worker, why_lost(error))
        rejected = len(replies.rejected)
        self.rejections += rejected
        if feedback:  # rank order: the order of `active`
            self.generator.update(batches, feedback)
        updated = time.perf_counter()

        swap_round, lost_in_swap = await self._swaps_after(t)
        lost += lost_in_swap
        finished = time.perf_counter()
        return IterationRecord(
            iteration=t, active_workers=len(active), answered=len(feedback), rejected=rejected, lost=lost,
            gen_loss=mean([s.gen_loss for s in stats]), disc_loss=mean([s.disc_loss for s in stats]),
            real_accuracy=mean([s.real_accuracy for s in stats]), fake_accuracy=mean([s.fake_accuracy for s in stats]),
            swap_round=swap_round, seconds=finished - started, generate_seconds=generated - started,
            wait_seconds=answered - generated, update_seconds=updated - answered, swap_seconds=finished - updated,
            privacy=dict(self.privacy) or None)

    async def _partial_iteration(self, t: int) -> IterationRecord:
        """--sync quorum|async (mdgan/algorithms/mdgan/synchrony.py): wait for some of the workers, not all."""
        started = time.perf_counter()
        exchange = await self.partial.exchange(self, t)
        harvest = exchange.harvest
        stats = read_stats(harvest.stats)
        self.rejections += harvest.rejected
        updated = time.perf_counter()
        swap_round, lost_in_swap = await self._swaps_after(t)
        finished = time.perf_counter()
        return IterationRecord(
            iteration=t, active_workers=exchange.issued, answered=len(stats), rejected=harvest.rejected,
            lost=harvest.lost + lost_in_swap,
            gen_loss=mean([s.gen_loss for s in stats]), disc_loss=mean([s.disc_loss for s in stats]),
            real_accuracy=mean([s.real_accuracy for s in stats]), fake_accuracy=mean([s.fake_accuracy for s in stats]),
            swap_round=swap_round, seconds=finished - started, wait_seconds=exchange.waiting,
            update_seconds=exchange.updating,
            generate_seconds=max(0.0, updated - started - exchange.waiting - exchange.updating),
            swap_seconds=finished - updated, late=harvest.late, privacy=dict(self.privacy) or None)

    async def _swaps_after(self, t: int) -> tuple[int | None, int]:
        """Boundary t's swaps: install the background round due here, then start the round of t if it
        is a swap boundary (lag 0: swap at once). (the round started here or None, workers lost)"""
        lost = 0
        if self.pending is not None and self.pending.install_at <= t:
            lost += await self.finish_swap(t)
        if t % self.swap_period != 0 or len(self.roster.members()) < 2:
            return None, lost
        swap_round, lost_in_swap = await (self.begin_swap(t) if self.swap_lag else self.swap(t))
        return swap_round, lost + lost_in_swap

    def _plan(self, swap_round: int) -> tuple[dict[str, str], dict[WorkerHandle, SwapOrder]]:
        """The round's random derangement over the active workers: (sender -> receiver, each one's order)."""
        participants = [w for w in self.roster.members() if not w.needs_copy]
        plan = derangement([w.worker_id for w in participants], self.config.seed, swap_round)
        receive_from = {dst: src for src, dst in plan.items()}
        return plan, {w: SwapOrder(swap_round, plan[w.worker_id], receive_from[w.worker_id]) for w in participants}

    async def _ask_swap(self, orders: dict[WorkerHandle, SwapOrder], call, swap_round: int):
        """call(worker, its order) for every participant, each within the swap deadline; a worker lost
        meanwhile has its two peers told at once (the one that waits for its discriminator, and the one
        that pushes to it), each of which would otherwise spend a whole deadline on it."""
        by_id = {w.worker_id: w for w in orders}

        async def one(worker: WorkerHandle):
            order = orders[worker]
            try:
                return await with_deadline(call(worker, order), self.swap_timeout)
            except (WorkerLost, asyncio.TimeoutError) as exc:
                await self._tell_peers(by_id, order, worker.worker_id, why_lost(exc, "deadline"))
                raise

        return await ask_all(list(orders), one, None)

    @staticmethod
    async def _tell_peers(by_id: dict[str, WorkerHandle], order: SwapOrder, left: str, why: str) -> None:
        """`left` is gone from the round of `order` (its order): its receiver stops waiting for its
        discriminator, its sender stops pushing to it."""
        receiver, sender = by_id.get(order.send_to), by_id.get(order.receive_from)
        try:
            if receiver is not None:
                await receiver.cancel_swap(order.swap_round, left, why)
        except Exception:  # the peer may be gone too; its own call reports that
            pass
        try:
            if sender is not None:
                await sender.cancel_push(order.swap_round, left, why)
        except Exception:
            pass

    async def _record(self, swap_round: int, t: int, plan: dict, participants: list[WorkerHandle], reports,
                      gone: dict[WorkerHandle, str] | None = None, installed: int | None = None) -> int:
        """Count and record a finished round (swaps.jsonl); `gone`: participants lost before it ended
        (counted as lost already), with why. The workers lost in `reports`."""
        outcome, lost = {}, 0
        for worker, report in reports.good:
            self.traffic.payload_bytes["worker_to_worker"] += report.sent_bytes
            outcome[worker.worker_id] = {"sent": report.sent, "received": report.received,
                                         "sent_bytes": report.sent_bytes, "error": report.error,
                                         **({"refused": report.refused} if report.refused else {})}
            self.swaps_refused += bool(report.refused)
            if not (report.sent and report.received):
                log.warning("swap %d: %s sent=%s received=%s %s", swap_round, worker.worker_id,
                            report.sent, report.received, report.error)
        for worker, why in (gone or {}).items():
            outcome[worker.worker_id] = {"sent": False, "received": False, "sent_bytes": 0, "error": why}
        for worker, error in reports.lost:
            outcome[worker.worker_id] = {"sent": False, "received": False, "sent_bytes": 0,
                                         "error": why_lost(error, "missed its swap deadline")}
            lost += await self.lose(worker, why_lost(error, "missed its swap deadline"))
        outcome = {w.worker_id: outcome[w.worker_id] for w in participants if w.worker_id in outcome}  # rank order
        if self.on_swap is not None:
            self.on_swap({"round": swap_round, "iteration": t, **({"installed": installed} if installed else {}),
                          "plan": plan, "workers": outcome})
        return lost

    async def swap(self, t: int) -> tuple[int, int]:
        """One swap round over the active workers, along a random derangement, as a barrier (the paper's):
        every worker sends its D and installs its peer's before iteration t + 1. (round, workers lost)"""
        swap_round = self.swaps + 1
        plan, orders = self._plan(swap_round)
        reports = await self._ask_swap(orders, lambda w, order: w.swap(order), swap_round)
        self.swaps = swap_round
        return swap_round, await self._record(swap_round, t, plan, list(orders), reports)

    async def begin_swap(self, t: int) -> tuple[int, int]:
        """A background round (--swap-lag L): every participant snapshots its D at boundary t and sends it
        while training goes on; finish_swap installs them at boundary t + L. (round, workers lost)"""
        swap_round = self.swaps + 1
        plan, orders = self._plan(swap_round)
        sent = await self._ask_swap(orders, lambda w, order: w.send_swap(order), swap_round)
        pending = PendingSwap(swap_round, t, t + self.swap_lag, plan, orders)
        lost = 0
        for worker, error in sent.lost:
            pending.lost[worker] = why_lost(error, "missed its swap deadline")
            lost += await self.lose(worker, pending.lost[worker])
        self.swaps, self.pending = swap_round, pending
        return swap_round, lost

    async def finish_swap(self, t: int) -> int:
        """Install the background round's discriminators at boundary t (its install_at, or earlier when
        the run stops): every participant still in takes its peer's D, waiting only for one that has
        not arrived. The workers lost."""
        pending, self.pending = self.pending, None
        members = set(self.roster.members())
        by_id = {w.worker_id: w for w in pending.orders}
        installing = {}
        for worker, order in pending.orders.items():
            if worker in pending.lost:
                continue
            if worker not in members:  # left since: whatever it sent may have arrived; nothing more will
                pending.lost[worker] = "left during the swap round"
                await self._tell_peers(by_id, order, worker.worker_id, pending.lost[worker])
                continue
            installing[worker] = order
        reports = await self._ask_swap(installing, lambda w, order: w.install_swap(order), pending.swap_round)
        return await self._record(pending.swap_round, pending.started, pending.plan, list(pending.orders), reports,
                                  pending.lost, installed=t)

    # -- checkpoints -------------------------------------------------------------------------
    async def checkpoint(self, t: int) -> bool:
        """Every member saves its state for boundary t, and the server its own (save_checkpoint);
        True when all of them wrote theirs (the checkpoint is complete)."""
        self.checkpoint_started = time.perf_counter()
        members = self.roster.members()

        async def save(worker: WorkerHandle) -> str | None:  # None: saved; else why not (a failed write too)
            try:
                return await worker.checkpoint(t)
            except (WorkerLost, asyncio.TimeoutError):
                raise
            except Exception as exc:
                return repr(exc)

        replies = await ask_all(members, save, self.checkpoint_timeout)
        # A worker lost during it, or none left at all (as when a SIGTERM reaches the whole cluster at
        # once): not complete. Resumed, it gave every worker a fresh discriminator ("a copy" of nobody's);
        # the checkpoint before has them all.
        wrote_all = bool(members) and not replies.lost and all(why is None for why in replies.answers)
        for worker, error in replies.lost:  # its discriminator is in no state of this checkpoint
            await self._drop(worker, why_lost(error, "missed its checkpoint deadline"))
        for worker, why in replies.good:
            if why is not None:
                log.warning("checkpoint %d: %s did not save its state: %s", t, worker.worker_id, why)
        if self.save_checkpoint is not None:
            self.save_checkpoint(t, wrote_all)
        self._last_checkpoint = t
        return wrote_all

    def _save_final(self, t: int) -> None:
        """The run's end on disk before any worker hears of it. Told the run is finished, a worker
        forgets it and leaves; a server killed after telling them, before writing its outputs, resumes
        from here (`finished`) with nothing left to train, instead of waiting for workers that are gone.
        The workers need not save: nothing will ever train their discriminators again."""
        if not (self.checkpoint_every and self.save_checkpoint is not None) or self._last_checkpoint == t:
            return
        self.checkpoint_started = time.perf_counter()
        self.save_checkpoint(t, True)
        self._last_checkpoint = t

    @property
    def finished(self) -> bool:
        """Every iteration of the run is done (resumed from its final checkpoint, or run to the end)."""
        return self.completed >= self.config.iterations

    async def wait_to_finish(self, timeout: float) -> None:
        """Resumed from the final checkpoint: give the workers of that checkpoint `timeout` seconds to
        come back, so that those who never heard of the end are told (run() tells whoever is in);
        those who heard it have left, and are not waited for longer."""
        roster = self.roster
        if not await roster.wait_for(roster.start_quorum, timeout, roster.expected):
            log.info("the run had finished: %d of the workers of its final checkpoint came back within %.0f s "
                     "to hear it (the others had heard it already, or will find no server)",
                     len(roster.alive()), timeout)
        roster.started = True

    # -- the loop ----------------------------------------------------------------------------
    async def run(self) -> RunResult:
        if not self.roster.started:
            await self.wait_to_start(None)
        if self.swap_period is None:
            shard_size = min((w.shard_size for w in self.roster.alive()), default=0)
            self.swap_period = self.config.swap_period(shard_size)
        check_lag(self.swap_lag, self.swap_period)
        last, stopped = None, None
        t = self.completed
        while t < self.until:
            if self.on_boundary is not None:
                self.on_boundary(t)
            if self.stop_requested:
                stopped = f"stopped by a signal after iteration {t}"
                if self.pending is not None:
                    # A checkpoint holds no round in flight, so this one is installed now, before its
                    # boundary: the run resumed from here is no longer bit for bit the uninterrupted one.
                    log.warning("stopping inside background swap round %d: its discriminators are installed at "
                                "%d instead of %d", self.pending.swap_round, t, self.pending.install_at)
                    await self.finish_swap(t)
                if self.checkpoint_every and self._last_checkpoint != t:
                    await self.checkpoint(t)
                break
            members, _ = self.roster.at_boundary(t)
            if len(members) < self.roster.keep_quorum:
                if await self._pause(t):
                    continue
                stopped = f"no workers left after iteration {t}" if not members else \
                    f"only {len(members)} workers after iteration {t}, fewer than --min-workers {self.roster.keep_quorum}"
                if self.roster.faults:
                    stopped += f": {self.roster.failures()}"
                log.error(stopped)
                break
            waiting = [w for w in members if w.needs_copy]
            if waiting:
                await self._admit(waiting, t)
            if not [w for w in self.roster.members() if not w.needs_copy]:
                continue  # every member was lost while admitting: pause or stop at the boundary
            t += 1
            last = await self.iteration(t)
            self.completed = t
            if self.on_iteration is not None:
                self.on_iteration(last)
            if self.checkpoint_every and t % self.checkpoint_every == 0:
                self._checkpoint_due = True
            # A checkpoint holds no background round in flight: one due inside a round is taken at the
            # boundary that installs it (a resumed run then goes on bit for bit).
            if self._checkpoint_due and self.pending is None and t < self.config.iterations:
                self._checkpoint_due = False
                await self.checkpoint(t)
        if self.partial is not None:
            self.partial.abandon()
        if self.pending is not None and stopped is None:  # the last round: installed, counted, recorded
            await self.finish_swap(t)
        if stopped is None and not self.stop_requested:
            self._save_final(t)
        alive = self.roster.alive()
        if not self.stop_requested:  # a stopped server leaves its workers to reconnect to its successor
            for worker in alive:
                await tell_to_stop(worker, RUN_FINISHED, 10.0)
        return RunResult(iterations=t, workers=self.roster.slots, workers_alive=len(alive), swaps=self.swaps,
                         rejections=self.rejections, swaps_refused=self.swaps_refused,
                         privacy=dict(self.privacy), swap_period=self.swap_period, traffic=self.traffic, last=last,
                         stopped_early=stopped, alive=[w.worker_id for w in alive])
