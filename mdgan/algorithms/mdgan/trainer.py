"""The MD-GAN training loop, written once over an abstract worker handle.

``Trainer`` drives global iterations against ``WorkerHandle`` objects. ``InProcessWorker``
(inprocess.py) is a handle over a DiscriminatorSide in this process; the gRPC server provides a handle
over a stream (services/server/algorithms/mdgan.py). Both run this same loop, so both end with the
same generator, bit for bit.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Callable

import torch

from mdgan import compression
from mdgan.algorithms.base import RUN_FINISHED, IterationRecord, RunResult, Traffic, last_iteration, mean, tell_to_stop
from mdgan.algorithms.mdgan.checkpoints import BoundaryCheckpoints
from mdgan.algorithms.mdgan.handle import COPY, SWAP, SwapOrder, SwapReport, WorkerHandle  # noqa: F401  (re-exported)
from mdgan.algorithms.mdgan.membership import Membership
from mdgan.algorithms.mdgan.options import check_lag
from mdgan.algorithms.mdgan.iterations import iteration_strategy
from mdgan.algorithms.mdgan.swaps import SwapRounds, SwapsAtBoundary
from mdgan.config import TrainingConfig
from mdgan.gan import GeneratorSide, WorkerBatch
from mdgan.roster import Roster
from mdgan.step_results import StepResult

log = logging.getLogger(__name__)


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def step_means(stats: list[StepResult]) -> dict[str, float]:
    """An iteration record's losses and accuracies: means over the answers used (stats read to the host)."""
    return {name: mean([getattr(s, name) for s in stats])
            for name in ("gen_loss", "disc_loss", "real_accuracy", "fake_accuracy")}


def _wire_nbytes(t: torch.Tensor, wire_dtype: str) -> int:
    """Bytes of a float32 tensor as it travels (compressed: values and int8 scales)."""
    return compression.packed_nbytes(tuple(t.shape), wire_dtype)


@dataclass(frozen=True)
class TrainerPlan:
    """What a run asks of the loop beyond its config: deadlines in seconds (None: none) for a step, a swap
    round and a checkpoint (default: the swap's); a checkpoint every `checkpoint_every` iterations (0: none);
    background swaps installed `swap_lag` iterations later; `pipeline_depth` iterations of batches in flight;
    stop after `stop_after` iterations, as the whole run trains them (experiments/replay.py)."""

    step_timeout: float | None = None
    swap_timeout: float | None = None
    checkpoint_every: int = 0
    checkpoint_timeout: float | None = None
    swap_lag: int = 0
    pipeline_depth: int = 0
    stop_after: int | None = None


@dataclass(frozen=True)
class TrainerHooks:
    """What the loop tells its run: each iteration's record, each swap round's record, each boundary before
    it is crossed, and `save_checkpoint(iteration, wrote_all)` (the server's part of a checkpoint)."""

    on_iteration: Callable[[IterationRecord], None] | None = None
    on_swap: Callable[[dict], None] | None = None
    on_boundary: Callable[[int], None] | None = None
    save_checkpoint: Callable[[int, bool], None] | None = None


class Trainer:
    """Runs I global iterations of MD-GAN against worker handles: the loop, and the accounting of each
    iteration (traffic, rejections, what each private site spent). Its parts: Membership (the roster
    asked at each boundary, drops, pauses, late joiners' copies), SwapRounds (barrier and background
    swaps) and BoundaryCheckpoints (with `checkpoint_every`, at every such boundary the workers save
    their state and `save_checkpoint(iteration, wrote_all)` saves the server's).
    """

    def __init__(self, config: TrainingConfig, generator: GeneratorSide, workers: list[WorkerHandle] | None = None, *,
                 roster: Roster | None = None, plan: TrainerPlan = TrainerPlan(), hooks: TrainerHooks = TrainerHooks()):
        self.config = config
        self.until = last_iteration(config, plan.stop_after)  # (stop_after: no checkpoints; simulate refuses both)
        self.generator = generator
        if roster is None:  # a fixed set of workers, all present from the start
            roster = Roster(config.workers, copies=not config.privacy.keeps_discriminators)
            for w in workers or []:
                roster.arrive(w.shard_index, w.worker_id, w)
            roster.at_boundary(0)  # all of them members from the first iteration
            roster.started = True
        self.step_timeout = plan.step_timeout
        self.on_iteration = hooks.on_iteration
        self.on_boundary = hooks.on_boundary
        self.traffic = Traffic()
        self.membership = Membership(roster, self.traffic, plan.swap_timeout, hooks.on_swap)
        self.swap_rounds = SwapRounds(config.seed, self.membership, self.traffic, plan.swap_timeout, plan.swap_lag,
                                      hooks.on_swap)
        self.checkpoints = BoundaryCheckpoints(self.membership, plan.checkpoint_every,
                                               plan.checkpoint_timeout or plan.swap_timeout, hooks.save_checkpoint)
        self._checkpoint_due = False  # a checkpoint boundary fell inside a background round: taken after it
        self.rejections = 0
        self.privacy: dict[str, dict] = {}  # DP: worker id -> the (epsilon, delta) it last reported
        self.completed = 0  # iterations done (the boundary the run stands at)
        self.swap_period: int | None = None  # S; None also where no discriminator leaves its site
        if workers:  # a fixed set: each worker's own m_n is known now (S from the smallest, see swap_period)
            self.swap_period = config.swap_period(min(w.shard_size for w in workers))
            check_lag(plan.swap_lag, self.swap_period)
        self.stop_requested = False  # set by a signal handler: checkpoint at the next boundary and stop
        self.strategy = iteration_strategy(config, plan.pipeline_depth)  # all, quorum|async, or pipelined

    # -- its parts, as the services and the in-process run see them ----------------------------
    @property
    def roster(self) -> Roster:
        return self.membership.roster

    @property
    def swaps(self) -> int:
        return self.swap_rounds.swaps

    @property
    def pending(self):
        """The background swap round under way (swaps.PendingSwap), or None."""
        return self.swap_rounds.pending

    @property
    def checkpoint_started(self) -> float:
        return self.checkpoints.started

    async def wait_to_start(self, timeout: float | None) -> None:
        await self.membership.wait_to_start(timeout)

    async def wait_to_finish(self, timeout: float) -> None:
        await self.membership.wait_to_finish(timeout)

    async def lose(self, worker: WorkerHandle, why: str) -> int:
        return await self.membership.lose(worker, why)

    async def checkpoint(self, t: int) -> bool:
        await self.strategy.drain()  # the checkpoint holds the answers in flight, not their futures
        return await self.checkpoints.checkpoint(t)

    @property
    def active(self) -> list[WorkerHandle]:
        return self.roster.members()

    # -- durable state -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"completed": self.completed, "swaps": self.swaps, "rejections": self.rejections,
                "swaps_refused": self.swap_rounds.swaps_refused, "privacy": dict(self.privacy),
                "swap_period": self.swap_period, "payload_bytes": dict(self.traffic.payload_bytes),
                "label_bytes": self.traffic.label_bytes, "roster": self.roster.state_dict(), **self.strategy.state()}

    def load_state_dict(self, state: dict) -> None:
        self.completed = self.checkpoints.last = int(state["completed"])
        self.swap_rounds.swaps, self.rejections = int(state["swaps"]), int(state["rejections"])
        self.swap_rounds.swaps_refused = int(state.get("swaps_refused", 0))  # (a checkpoint from before the check)
        self.privacy = dict(state.get("privacy", {}))
        self.swap_period = None if state["swap_period"] is None else int(state["swap_period"])
        self.traffic.payload_bytes.update(state["payload_bytes"])
        self.traffic.label_bytes = int(state["label_bytes"])
        self.roster.load_state_dict(state["roster"], self.completed)
        self.strategy.restore(state, self.generator)

    def count_batch(self, batch: WorkerBatch) -> None:
        """Traffic of one worker's batches, as they travel."""
        wire = self.config.wire_dtype
        self.traffic.payload_bytes["server_to_worker"] += (_wire_nbytes(batch.generated, wire)
                                                           + _wire_nbytes(batch.discriminated, wire))
        self.traffic.label_bytes += _nbytes(batch.generated_labels) + _nbytes(batch.discriminated_labels)

    def count_feedback(self, reply: StepResult, worker_id: str | None = None) -> None:
        self.traffic.payload_bytes["worker_to_server"] += _wire_nbytes(reply.feedback, self.config.wire_dtype)
        if worker_id is not None and math.isfinite(reply.epsilon):  # DP: what that site says it has spent
            self.privacy[worker_id] = {"epsilon": reply.epsilon, "delta": reply.delta,
                                       "noise": "fixed" if reply.fixed_noise else "secret"}

    # -- one iteration -----------------------------------------------------------------------
    async def iteration(self, t: int) -> IterationRecord:
        """The strategy's exchange, then the boundary's swaps (mdgan/algorithms/mdgan/iterations.py)."""
        started = time.perf_counter()
        done = await self.strategy.exchange(self, t)
        self.rejections += done.rejected
        updated = time.perf_counter()
        swaps = await self._swaps_after(t)
        finished = time.perf_counter()
        return IterationRecord(
            iteration=t, active_workers=done.issued, answered=len(done.stats), rejected=done.rejected,
            lost=done.lost + swaps.lost, **step_means(done.stats), swap_round=swaps.started,
            seconds=finished - started, generate_seconds=done.generate_seconds, wait_seconds=done.wait_seconds,
            update_seconds=done.update_seconds, swap_seconds=finished - updated, late=done.late,
            privacy=dict(self.privacy) or None)

    async def _swaps_after(self, t: int) -> SwapsAtBoundary:
        """Boundary t's swaps: install the background round due here, then start the round of t if it
        is a swap boundary (lag 0: swap at once)."""
        lost = 0
        rounds = self.swap_rounds
        if rounds.pending is not None and rounds.pending.install_at <= t:
            lost += await rounds.finish_swap(t)
        if self.swap_period is None or t % self.swap_period != 0 or len(rounds.participants()) < 2:
            return SwapsAtBoundary(None, lost)  # (a member waiting for its copy has no discriminator to send)
        started = await (rounds.begin_swap(t) if rounds.swap_lag else rounds.swap(t))
        return SwapsAtBoundary(started.started, lost + started.lost)

    @property
    def finished(self) -> bool:
        """Every iteration of the run is done (resumed from its final checkpoint, or run to the end)."""
        return self.completed >= self.config.iterations

    # -- the loop ----------------------------------------------------------------------------
    async def run(self) -> RunResult:
        if not self.roster.started:
            await self.wait_to_start(None)
        if self.swap_period is None:  # (stays None for a run without swaps: TrainingConfig.swap_period)
            shard_size = min((w.shard_size for w in self.roster.alive()), default=0)
            self.swap_period = self.config.swap_period(shard_size)
        check_lag(self.swap_rounds.swap_lag, self.swap_period)
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
                    await self.swap_rounds.finish_swap(t)
                if self.checkpoints.every and self.checkpoints.last != t:
                    await self.checkpoint(t)
                break
            members = self.roster.at_boundary(t).members
            if len(members) < self.roster.keep_quorum:
                if await self.membership.pause(t):
                    continue
                stopped = f"no workers left after iteration {t}" if not members else \
                    f"only {len(members)} workers after iteration {t}, fewer than --min-workers {self.roster.keep_quorum}"
                if self.roster.faults:
                    stopped += f": {self.roster.failures()}"
                log.error(stopped)
                break
            waiting = [w for w in members if w.needs_copy]
            if waiting:
                await self.membership.admit(waiting, t)
            if not [w for w in self.roster.members() if not w.needs_copy]:
                continue  # every member was lost while admitting: pause or stop at the boundary
            t += 1
            last = await self.iteration(t)
            self.completed = t
            if self.on_iteration is not None:
                self.on_iteration(last)
            if self.checkpoints.every and t % self.checkpoints.every == 0:
                self._checkpoint_due = True
            # A checkpoint holds no background round in flight: one due inside a round is taken at the
            # boundary that installs it (a resumed run then goes on bit for bit).
            if self._checkpoint_due and self.pending is None and t < self.config.iterations:
                self._checkpoint_due = False
                await self.checkpoint(t)
        await self.strategy.close(self, stopped is not None)
        if self.pending is not None and stopped is None:  # the last round: installed, counted, recorded
            await self.swap_rounds.finish_swap(t)
        if stopped is None and not self.stop_requested:
            self.checkpoints.save_final(t)
        alive = self.roster.alive()
        if not self.stop_requested:  # a stopped server leaves its workers to reconnect to its successor
            for worker in alive:
                await tell_to_stop(worker, RUN_FINISHED, 10.0)
        return RunResult(iterations=t, workers=self.roster.slots, workers_alive=len(alive), swaps=self.swaps,
                         rejections=self.rejections, swaps_refused=self.swap_rounds.swaps_refused,
                         privacy=dict(self.privacy), swap_period=self.swap_period, traffic=self.traffic, last=last,
                         stopped_early=stopped, alive=[w.worker_id for w in alive])
