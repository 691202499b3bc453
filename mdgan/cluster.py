"""The MD-GAN training loop, written once over an abstract worker handle.

``Trainer`` drives global iterations against ``WorkerHandle`` objects. ``InProcessWorker`` is a
handle over a DiscriminatorSide in this process; the gRPC server provides a handle over a stream
(services/server). Both run this same loop, so both end with the same generator, bit for bit.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from mdgan import compression
from mdgan.checkpoint import CheckpointStore
from mdgan.config import TrainingConfig
from mdgan.mdgan import DiscriminatorSide, GeneratorSide, StepResult, WorkerBatch, derangement
from mdgan.roster import Roster
from mdgan.synchrony import PartialSync

log = logging.getLogger(__name__)


class WorkerLost(Exception):
    """The worker is gone (crashed, disconnected, or missed its deadline): it leaves the run."""


class InputRejected(Exception):
    """The worker answered with input that failed validation: this iteration goes on without it."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


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

    @abc.abstractmethod
    async def cancel_swap(self, swap_round: int, sender: str, reason: str, kind: str = SWAP) -> None:
        """`sender` left during the swap round (or the copy, kind COPY): stop waiting for its discriminator."""

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


# ---------------------------------------------------------------------------------------------

class InProcessSwapBoard:
    """Peer-to-peer delivery between in-process workers: one mailbox per (round, receiver)."""

    def __init__(self) -> None:
        self._boxes: dict[tuple[int, str], asyncio.Future] = {}

    def _box(self, swap_round: int, receiver: str) -> asyncio.Future:
        return self._boxes.setdefault((swap_round, receiver), asyncio.get_running_loop().create_future())

    def deliver(self, swap_round: int, receiver: str, sender: str, state: dict[str, torch.Tensor] | None) -> None:
        """`state` None: the sender left, nothing will come."""
        box = self._box(swap_round, receiver)
        if not box.done():
            box.set_result((sender, state))

    async def collect(self, swap_round: int, receiver: str, timeout: float) -> tuple[str, dict[str, torch.Tensor]]:
        try:
            return await asyncio.wait_for(self._box(swap_round, receiver), timeout)
        finally:
            self._boxes.pop((swap_round, receiver), None)


class InProcessWorker(WorkerHandle):
    def __init__(self, side: DiscriminatorSide, board: InProcessSwapBoard, swap_timeout: float = 60.0,
                 state: CheckpointStore | None = None,
                 attack: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.side = side
        self.attack = attack  # an emulated Byzantine worker (mdgan/attacks.py) replaces its feedback
        self.board = board
        self.swap_timeout = swap_timeout
        self.shard_index = side.shard_index
        self.worker_id = f"worker-{side.shard_index}"
        self.shard_size = len(side.sampler.shard)
        self.crashed = False
        self.state = state  # where this worker saves its checkpoints (its own state dir)

    def crash(self) -> None:
        """Emulate the paper's crash experiment: the worker and its data leave the run."""
        self.crashed = True

    async def step(self, iteration: int, batch: WorkerBatch) -> StepResult:
        if self.crashed:
            raise WorkerLost(f"{self.worker_id} crashed")
        # The same rounding at the same points as over gRPC: the batches, then the feedback.
        wire = self.side.config.wire_dtype
        result = self.side.step(dataclasses.replace(batch, generated=compression.round_trip(batch.generated, wire),
                                                    discriminated=compression.round_trip(batch.discriminated, wire)))
        feedback = result.feedback if self.attack is None else self.attack(result.feedback)
        return dataclasses.replace(result, feedback=compression.round_trip(feedback, wire))

    async def swap(self, order: SwapOrder) -> SwapReport:
        if self.crashed:
            raise WorkerLost(f"{self.worker_id} crashed")
        if order.kind == COPY:
            return await self._copy(order)
        state, sent = self._outgoing_state()
        self.board.deliver(order.swap_round, order.send_to, self.worker_id, state)
        try:
            sender, incoming = await self.board.collect(order.swap_round, self.worker_id, self.swap_timeout)
        except asyncio.TimeoutError:
            return SwapReport(order.swap_round, True, False, sent, "no discriminator arrived")
        if sender != order.receive_from or incoming is None:
            return SwapReport(order.swap_round, True, False, sent, f"nothing usable from {sender}")
        self.side.import_state(incoming)
        return SwapReport(order.swap_round, True, True, sent)

    def _outgoing_state(self) -> tuple[dict[str, torch.Tensor], int]:
        """This worker's D as its receiver gets it (rounded to the wire dtype, as over gRPC), and the
        payload bytes that travel."""
        wire = self.side.config.wire_dtype
        packed = compression.pack_state(self.side.export_state(), wire)
        return compression.unpack_state(packed, self.side.state_layout(), wire), compression.state_nbytes(packed)

    @staticmethod
    def _mailbox(swap_round: int, kind: str) -> int:
        """The board's key: copies have their own mailboxes, apart from swap rounds."""
        return -swap_round if kind == COPY else swap_round

    async def _copy(self, order: SwapOrder) -> SwapReport:
        key = self._mailbox(order.swap_round, COPY)
        if order.send_to:
            state, sent = self._outgoing_state()
            self.board.deliver(key, order.send_to, self.worker_id, state)
            return SwapReport(order.swap_round, True, False, sent)
        try:
            sender, incoming = await self.board.collect(key, self.worker_id, self.swap_timeout)
        except asyncio.TimeoutError:
            return SwapReport(order.swap_round, False, False, 0, "no discriminator arrived")
        if sender != order.receive_from or incoming is None:
            return SwapReport(order.swap_round, False, False, 0, f"nothing usable from {sender}")
        self.side.adopt(incoming)
        return SwapReport(order.swap_round, False, True, 0)

    async def cancel_swap(self, swap_round: int, sender: str, reason: str, kind: str = SWAP) -> None:
        self.board.deliver(self._mailbox(swap_round, kind), self.worker_id, sender, None)

    async def checkpoint(self, iteration: int) -> str | None:
        if self.crashed:
            raise WorkerLost(f"{self.worker_id} crashed")
        if self.state is None:
            return "this worker keeps no state"
        self.state.save(iteration, "worker", self.side.state_dict())
        self.state.prune(marker=None)
        return None

    async def stop(self, reason: str) -> None:
        return None


# ---------------------------------------------------------------------------------------------

DIRECTIONS = ("server_to_worker", "worker_to_server", "worker_to_worker")
RUN_FINISHED = "run finished"  # the stop reason of a run that completed


@dataclass
class Traffic:
    """Payload bytes (tensor data) by direction, plus the ACGAN labels that ride with the batches."""

    payload_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0))
    label_bytes: int = 0


@dataclass
class IterationRecord:
    iteration: int
    active_workers: int
    answered: int
    rejected: int
    lost: int
    gen_loss: float
    disc_loss: float
    real_accuracy: float
    fake_accuracy: float
    swap_round: int | None
    seconds: float
    # phases of `seconds`: generating the k batches, waiting for the workers, updating G, swapping
    generate_seconds: float = 0.0
    wait_seconds: float = 0.0
    update_seconds: float = 0.0
    swap_seconds: float = 0.0
    late: int = 0  # --sync quorum|async: answers that came too late to count (dropped)


@dataclass
class RunResult:
    iterations: int
    workers: int
    workers_alive: int
    swaps: int
    rejections: int
    swap_period: int
    traffic: Traffic
    last: IterationRecord | None
    stopped_early: str | None = None
    alive: list[str] | None = None  # worker ids connected at the end


async def with_deadline(awaitable, timeout: float | None):
    """Await, within `timeout` seconds when one is given (raises asyncio.TimeoutError).

    asyncio.timeout, not wait_for: the same deadline without a task of its own for the awaitable
    (wait_for makes one per call, and this runs N times an iteration)."""
    if not timeout:
        return await awaitable
    async with asyncio.timeout(timeout):
        return await awaitable


async def tell_to_stop(worker, reason: str, timeout: float = 5.0) -> None:
    """Best effort: a worker being dropped may already be gone, and then there is nobody to tell."""
    try:
        await asyncio.wait_for(worker.stop(reason), timeout)
    except Exception as exc:
        log.debug("could not stop %s: %s", worker.worker_id, exc)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


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
                 save_checkpoint: Callable[[int, bool], None] | None = None):
        self.config = config
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
        # The last copy order's number. A worker's copy mailbox takes each number once, so a copy tried
        # again at the same boundary (its donor left) needs a new one: with the boundary's own number
        # again, the joiner refused every later copy as too old, and the run stood at that boundary.
        self._copy_round = 0
        self._counted_lost: set[WorkerHandle] = set()  # handles whose loss an iteration record counted
        self.rejections = 0
        self.completed = 0  # iterations done (the boundary the run stands at)
        self.swap_period: int | None = None
        if workers:  # a fixed set: each worker's own m_n is known now (S from the smallest, see swap_period)
            self.swap_period = config.swap_period(min(w.shard_size for w in workers))
        self.stop_requested = False  # set by a signal handler: checkpoint at the next boundary and stop
        self._last_checkpoint = 0
        self.checkpoint_started = 0.0  # perf_counter() when the checkpoint under way began
        # --sync quorum|async: the exchange of an iteration lives in mdgan/synchrony.py
        self.partial = PartialSync(config) if config.sync != "all" else None

    @property
    def active(self) -> list[WorkerHandle]:
        return self.roster.members()

    # -- durable state -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"completed": self.completed, "swaps": self.swaps, "rejections": self.rejections,
                "swap_period": self.swap_period, "payload_bytes": dict(self.traffic.payload_bytes),
                "label_bytes": self.traffic.label_bytes, "roster": self.roster.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.completed = self._last_checkpoint = int(state["completed"])
        self.swaps, self.rejections = int(state["swaps"]), int(state["rejections"])
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
                raise TimeoutError(f"{alive} of {roster.start_quorum} workers joined within {timeout:.0f} s")
        roster.started = True

    def count_batch(self, batch: WorkerBatch) -> None:
        """Traffic of one worker's batches, as they travel."""
        wire = self.config.wire_dtype
        self.traffic.payload_bytes["server_to_worker"] += (_wire_nbytes(batch.generated, wire)
                                                           + _wire_nbytes(batch.discriminated, wire))
        self.traffic.label_bytes += _nbytes(batch.generated_labels) + _nbytes(batch.discriminated_labels)

    def count_feedback(self, reply: StepResult) -> None:
        self.traffic.payload_bytes["worker_to_server"] += _wire_nbytes(reply.feedback, self.config.wire_dtype)

    async def _drop(self, worker: WorkerHandle, why: str) -> None:
        if self.roster.depart(worker):
            log.warning("dropping %s: %s", worker.worker_id, why)
            await tell_to_stop(worker, why)

    async def _lose(self, worker: WorkerHandle, why: str) -> int:
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
                why = str(gave) or "deadline"
            elif isinstance(gave, SwapReport) and not gave.sent:
                why = gave.error or "nothing sent"
            if why is not None:
                try:
                    await joiner.cancel_swap(copy_round, donor.worker_id, why, kind=COPY)
                except WorkerLost:
                    pass  # the joiner is gone too: its own report says so
            took, = await asyncio.gather(taking, return_exceptions=True)
            reports = (gave, took)
            for worker, report in zip((donor, joiner), reports):
                if isinstance(report, (WorkerLost, asyncio.TimeoutError)):
                    await self._drop(worker, str(report) or "missed its copy deadline")
                elif isinstance(report, BaseException):
                    raise report
                else:
                    self.traffic.payload_bytes["worker_to_worker"] += report.sent_bytes
            received = isinstance(reports[1], SwapReport) and reports[1].received
            if received:
                joiner.needs_copy = False
                log.info("%s took a copy of %s's discriminator before iteration %d", joiner.worker_id,
                         donor.worker_id, t + 1)
            elif self.roster.slot_of(joiner) is not None:
                detail = reports[1].error if isinstance(reports[1], SwapReport) else ""
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
        replies = await asyncio.gather(*(with_deadline(w.step(t, b), self.step_timeout) for w, b in zip(active, sent)),
                                       return_exceptions=True)
        answered = time.perf_counter()
        feedback, stats, rejected, lost = [], [], 0, 0
        for worker, batch, reply in zip(active, sent, replies):
            self.count_batch(batch)
            if isinstance(reply, StepResult):
                self.count_feedback(reply)
                feedback.append((batch.generated_index, reply.feedback))
                stats.append(reply)
            elif isinstance(reply, InputRejected):
                rejected += 1
                log.warning("iteration %d: %s rejected (%s)", t, worker.worker_id, reply)
            elif isinstance(reply, (WorkerLost, asyncio.TimeoutError)):
                lost += await self._lose(worker, str(reply) or "missed its deadline")
            else:
                raise reply
        self.rejections += rejected
        if feedback:  # rank order: the order of `active`
            self.generator.update(batches, feedback)
        updated = time.perf_counter()

        swap_round = None
        if t % self.swap_period == 0 and len(self.roster.members()) >= 2:
            swap_round, lost_in_swap = await self.swap(t)
            lost += lost_in_swap
        finished = time.perf_counter()
        return IterationRecord(
            iteration=t, active_workers=len(active), answered=len(feedback), rejected=rejected, lost=lost,
            gen_loss=_mean([s.gen_loss for s in stats]), disc_loss=_mean([s.disc_loss for s in stats]),
            real_accuracy=_mean([s.real_accuracy for s in stats]), fake_accuracy=_mean([s.fake_accuracy for s in stats]),
            swap_round=swap_round, seconds=finished - started, generate_seconds=generated - started,
            wait_seconds=answered - generated, update_seconds=updated - answered, swap_seconds=finished - updated)

    async def _partial_iteration(self, t: int) -> IterationRecord:
        """--sync quorum|async (mdgan/synchrony.py): wait for some of the workers, not all."""
        started = time.perf_counter()
        issued, stats, rejected, lost, late, waited, updating = await self.partial.exchange(self, t)
        self.rejections += rejected
        updated = time.perf_counter()
        swap_round = None
        if t % self.swap_period == 0 and len(self.active) >= 2:
            swap_round, lost_in_swap = await self.swap(t)
            lost += lost_in_swap
        finished = time.perf_counter()
        return IterationRecord(
            iteration=t, active_workers=issued, answered=len(stats), rejected=rejected, lost=lost,
            gen_loss=_mean([s.gen_loss for s in stats]), disc_loss=_mean([s.disc_loss for s in stats]),
            real_accuracy=_mean([s.real_accuracy for s in stats]), fake_accuracy=_mean([s.fake_accuracy for s in stats]),
            swap_round=swap_round, seconds=finished - started, wait_seconds=waited, update_seconds=updating,
            generate_seconds=max(0.0, updated - started - waited - updating), swap_seconds=finished - updated,
            late=late)

    async def swap(self, t: int) -> tuple[int, int]:
        """One swap round over the active workers, along a random derangement; (round, workers lost)."""
        swap_round = self.swaps + 1
        participants = [w for w in self.roster.members() if not w.needs_copy]
        plan = derangement([w.worker_id for w in participants], self.config.seed, swap_round)
        receive_from = {dst: src for src, dst in plan.items()}
        orders = [SwapOrder(swap_round, plan[w.worker_id], receive_from[w.worker_id]) for w in participants]
        by_id = {w.worker_id: w for w in participants}

        async def swap_one(worker: WorkerHandle, order: SwapOrder):
            try:
                return await with_deadline(worker.swap(order), self.swap_timeout)
            except (WorkerLost, asyncio.TimeoutError) as exc:
                # Its receiver would wait a whole swap deadline for a discriminator that cannot come.
                try:
                    await by_id[order.send_to].cancel_swap(swap_round, worker.worker_id, str(exc) or "deadline")
                except Exception:  # the receiver may be gone too; its own call reports that
                    pass
                raise

        reports = await asyncio.gather(*(swap_one(w, o) for w, o in zip(participants, orders)), return_exceptions=True)
        outcome, lost = {}, 0
        for worker, report in zip(participants, reports):
            if isinstance(report, SwapReport):
                self.traffic.payload_bytes["worker_to_worker"] += report.sent_bytes
                outcome[worker.worker_id] = {"sent": report.sent, "received": report.received,
                                             "sent_bytes": report.sent_bytes, "error": report.error}
                if not (report.sent and report.received):
                    log.warning("swap %d: %s sent=%s received=%s %s", swap_round, worker.worker_id,
                                report.sent, report.received, report.error)
            elif isinstance(report, (WorkerLost, asyncio.TimeoutError)):
                outcome[worker.worker_id] = {"sent": False, "received": False, "sent_bytes": 0,
                                             "error": str(report) or "missed its swap deadline"}
                lost += await self._lose(worker, str(report) or "missed its swap deadline")
            else:
                raise report
        self.swaps = swap_round
        if self.on_swap is not None:
            self.on_swap({"round": swap_round, "iteration": t, "plan": plan, "workers": outcome})
        return swap_round, lost

    # -- checkpoints -------------------------------------------------------------------------
    async def checkpoint(self, t: int) -> bool:
        """Every member saves its state for boundary t, and the server its own (save_checkpoint);
        True when all of them wrote theirs (the checkpoint is complete)."""
        self.checkpoint_started = time.perf_counter()
        members = self.roster.members()
        asked = asyncio.gather(*(with_deadline(w.checkpoint(t), self.checkpoint_timeout) for w in members),
                               return_exceptions=True)
        # A worker lost during it, or none left at all (as when a SIGTERM reaches the whole cluster at
        # once): not complete. Resumed, it gave every worker a fresh discriminator ("a copy" of nobody's);
        # the checkpoint before has them all.
        wrote_all = bool(members)
        for worker, reply in zip(members, await asked):
            if isinstance(reply, (WorkerLost, asyncio.TimeoutError)):
                wrote_all = False  # its discriminator is in no state of this checkpoint
                await self._drop(worker, str(reply) or "missed its checkpoint deadline")
            elif isinstance(reply, BaseException) or reply is not None:
                wrote_all = False
                log.warning("checkpoint %d: %s did not save its state: %s", t, worker.worker_id, reply)
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
        last, stopped = None, None
        t = self.completed
        while t < self.config.iterations:
            if self.on_boundary is not None:
                self.on_boundary(t)
            if self.stop_requested:
                stopped = f"stopped by a signal after iteration {t}"
                if self.checkpoint_every and self._last_checkpoint != t:
                    await self.checkpoint(t)
                break
            members, _ = self.roster.at_boundary(t)
            if len(members) < self.roster.keep_quorum:
                if await self._pause(t):
                    continue
                stopped = f"no workers left after iteration {t}" if not members else \
                    f"only {len(members)} workers after iteration {t}, fewer than --min-workers {self.roster.keep_quorum}"
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
            if self.checkpoint_every and t % self.checkpoint_every == 0 and t < self.config.iterations:
                await self.checkpoint(t)
        if stopped is None and not self.stop_requested:
            self._save_final(t)
        alive = self.roster.alive()
        if not self.stop_requested:  # a stopped server leaves its workers to reconnect to its successor
            for worker in alive:
                await tell_to_stop(worker, RUN_FINISHED, 10.0)
        return RunResult(iterations=t, workers=self.roster.slots, workers_alive=len(alive), swaps=self.swaps,
                         rejections=self.rejections, swap_period=self.swap_period, traffic=self.traffic, last=last,
                         stopped_early=stopped, alive=[w.worker_id for w in alive])


def build_in_process_workers(config: TrainingConfig, shards, state_root: str | None = None, keep: int = 3,
                             byzantine: int = 0, attack: str | None = None) -> list[InProcessWorker]:
    """One in-process worker per shard; with state_root, worker k keeps its state in state_root/worker-k;
    the last `byzantine` by rank replace their feedback by `attack`."""
    from mdgan.attacks import FeedbackAttack, attackers

    bad = set(attackers(len(shards), byzantine)) if attack else set()
    board = InProcessSwapBoard()
    return [InProcessWorker(DiscriminatorSide(config, shard), board,
                            state=CheckpointStore(f"{state_root}/worker-{shard.index}", keep) if state_root else None,
                            attack=FeedbackAttack(attack, config.seed, shard.index) if shard.index in bad else None)
            for shard in shards]
