"""Membership: who is in the run at each iteration boundary (DESIGN.md section 7).

The run has N slots, 0..N-1; a slot is a rank and a shard index. The first identity that holds a
slot keeps it for the whole run (and across resumes: the binding is saved in checkpoints): another
identity asking for it is refused, the same identity coming back gets it again. Transports (the
gRPC Coordinator, the in-process simulation) report arrivals and departures; the training loop
asks `at_boundary()` who is in before each iteration, so a worker that arrives mid-iteration
starts at the next boundary, in rank order, and every transport sees the same membership.

`min_workers` M: training starts once M workers are in, goes on while at least M are alive,
pauses below M and gives up after `pause_timeout` seconds (0: at once; None: never). Unset: it starts with all N (or, on
resume, with every worker that was alive at the checkpoint) and goes on while one is alive.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

log = logging.getLogger("mdgan.roster")


class WorkersFailed(RuntimeError):
    """The workers a run needs to start reported their own errors (Roster.failures says which)."""


class SlotRefused(Exception):
    """A join that the roster cannot take. `kind` says why, for the transport's status code:
    "out_of_range", "taken_by_other" (another identity holds the slot: a permission matter),
    "busy" (the slot's holder is still connected), "full" (no free slot to assign)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class RejoinPlan:
    """How a worker joining now gets its discriminator.

    restore: the iteration of its own saved state to load (0: none); copy: it needs a copy of a
    live peer's discriminator (Adam reset) before its first batch, as the paper says for late joiners.
    """

    restore: int = 0
    copy: bool = False


@dataclass(frozen=True)
class Boundary:
    """Who takes part from an iteration boundary on: the members in rank order, and those of them new there."""
    members: list
    newcomers: list


class Roster:
    # While it waits for workers, the roster says every this many seconds how many are in: a server
    # waiting for a join that never comes would otherwise be silent until its join timeout.
    report_every = 30.0

    def __init__(self, slots: int, min_workers: int | None = None, pause_timeout: float | None = 0.0,
                 copies: bool = True):
        if slots < 1:
            raise ValueError("a run has at least one slot")
        if min_workers is not None and not 1 <= min_workers <= slots:
            raise ValueError(f"--min-workers must be in [1, workers={slots}], got {min_workers}")
        self.slots = slots
        self.min_workers = min_workers
        self.pause_timeout = pause_timeout
        self.copies = copies  # False: no discriminator moves between workers; a joiner without state starts fresh
        self.bindings: dict[int, str] = {}  # slot -> identity, for the whole run
        self._alive: dict[int, object] = {}  # slot -> handle of the connected worker
        self._admitted: dict[int, object] = {}  # slot -> handle taking part in iterations
        self.iteration = 0  # the last iteration boundary passed (completed iterations)
        self.started = False
        self.resumed_from = 0  # the checkpoint iteration this run resumed from (0: none)
        self.expected: set[int] | None = None  # on resume: the slots alive at the checkpoint
        # slot -> (identity, "failed while ...: cause"): a worker that reported its own error, until it
        # joins again. Nobody waits for it: a quorum that only it could make is lost at once.
        self.faults: dict[int, tuple[str, str]] = {}
        self.changed = asyncio.Event()  # set on every arrival and departure

    # -- quorum ------------------------------------------------------------------------------
    @property
    def start_quorum(self) -> int:
        if self.min_workers is not None:
            return self.min_workers
        return len(self.expected) if self.expected else self.slots

    @property
    def keep_quorum(self) -> int:
        return self.min_workers or 1

    # -- what transports report ----------------------------------------------------------------
    def claim(self, slot: int | None, identity: str) -> int:
        """The slot this identity may take (slot None: its bound slot, else the lowest free one).
        Raises SlotRefused."""
        if slot is None:
            bound = [s for s, who in self.bindings.items() if who == identity]
            if bound:
                slot = bound[0]
            else:
                free = [s for s in range(self.slots) if s not in self.bindings and s not in self._alive]
                if not free:
                    raise SlotRefused("full", f"all {self.slots} slots are taken")
                slot = free[0]
        if not 0 <= slot < self.slots:
            raise SlotRefused("out_of_range", f"slot {slot} is not in 0..{self.slots - 1}")
        holder = self.bindings.get(slot)
        if holder is not None and holder != identity:
            raise SlotRefused("taken_by_other", f"slot {slot} belongs to {holder!r} in this run, not to {identity!r}")
        held = [s for s, who in self.bindings.items() if who == identity and s != slot]
        if held:  # one identity, one slot: a worker cannot take a second shard's data into the run
            raise SlotRefused("taken_by_other", f"{identity!r} holds slot {held[0]} in this run, not slot {slot}")
        if slot in self._alive:
            raise SlotRefused("busy", f"slot {slot} already has a connected worker")
        return slot

    def arrive(self, slot: int, identity: str, handle) -> None:
        """A worker is connected for `slot`; it takes part from the next iteration boundary."""
        self.claim(slot, identity)
        self.bindings[slot] = identity
        self._alive[slot] = handle
        self.faults.pop(slot, None)
        self._notify()

    def fault(self, slot: int, identity: str, cause: str) -> None:
        """The worker in `slot` failed ("failed while ...: cause"); its departure is reported apart."""
        self.faults[slot] = (identity, cause)
        self._notify()

    def failures(self) -> str:
        """The faults in one line, workers with the same cause together ("" when none)."""
        by_cause: dict[str, list[str]] = {}
        for slot in sorted(self.faults):
            identity, cause = self.faults[slot]
            by_cause.setdefault(cause, []).append(identity)
        return "; ".join(f"{', '.join(who)} {cause}" for cause, who in by_cause.items())

    def depart(self, handle) -> bool:
        """The worker behind `handle` left (crashed, disconnected, dropped). False if it was not in."""
        for slot, current in list(self._alive.items()):
            if current is handle:
                del self._alive[slot]
                self._admitted.pop(slot, None)
                self._notify()
                return True
        return False

    # -- what the training loop asks ---------------------------------------------------------
    def at_boundary(self, iteration: int) -> Boundary:
        """The members from this boundary on (those new since the last boundary among them)."""
        self.iteration = iteration
        newcomers = [h for s, h in sorted(self._alive.items()) if self._admitted.get(s) is not h]
        self._admitted = dict(self._alive)
        return Boundary(self.members(), newcomers)

    def members(self) -> list:
        return [h for _, h in sorted(self._admitted.items())]

    def alive(self) -> list:
        return [h for _, h in sorted(self._alive.items())]

    def slot_bound_to(self, identity: str) -> int | None:
        """The slot this identity holds in the run (connected or not), if any."""
        return next((s for s, who in self.bindings.items() if who == identity), None)

    def slot_of(self, handle) -> int | None:
        return next((s for s, h in self._alive.items() if h is handle), None)

    async def wait_for(self, count: int, timeout: float | None, slots: set[int] | None = None) -> bool:
        """Wait until `count` workers are connected (all of `slots` when given); False on timeout, or at
        once when failed workers put it out of reach."""
        def enough() -> bool:
            return slots.issubset(self._alive) if slots else len(self._alive) >= count

        def out_of_reach() -> bool:  # failed workers do not come back by themselves
            return bool(slots & self.faults.keys()) if slots else self.slots - len(self.faults) < count

        need = len(slots) if slots else count
        deadline = None if timeout is None else time.monotonic() + timeout
        report = time.monotonic() + self.report_every
        while not enough():
            now = time.monotonic()
            remaining = None if deadline is None else deadline - now
            if (remaining is not None and remaining <= 0) or out_of_reach():
                return False
            if now >= report:
                have = len(slots & self._alive.keys()) if slots else len(self._alive)
                log.info("waiting for workers: %d of %d in%s", have, need,
                         "" if remaining is None else f", {remaining:.0f} s left")
                report = now + self.report_every
            wake = report - now if remaining is None else min(remaining, report - now)
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), wake)
            except asyncio.TimeoutError:
                pass
        return True

    def rejoin_plan(self, held: list[int], trained: int) -> RejoinPlan:
        """The discriminator of a worker joining now: `held` are the iterations of the states it
        saved for this run, `trained` the last iteration its in-memory discriminator saw (0: none).

        Before the run (re)starts everyone must stand at the same point: the checkpoint resumed
        from (bit-exact when all restore it) or the common initialisation. Mid-run, a worker keeps
        what it has, else takes its newest saved state, else a copy of a live peer's."""
        if not self.started:
            if not self.resumed_from:
                return RejoinPlan()
            if self.resumed_from in held:
                return RejoinPlan(restore=self.resumed_from)
            return RejoinPlan(copy=self.copies)
        if trained:
            return RejoinPlan()
        if held:
            return RejoinPlan(restore=max(held))
        return RejoinPlan(copy=self.iteration > 0 and self.copies)

    def short_of(self, count: int, timeout: float | None) -> Exception:
        """Why fewer than `count` workers are in: WorkersFailed when failed workers put them out of
        reach, else a TimeoutError."""
        alive, failures = len(self._alive), self.failures()
        if failures:
            return WorkersFailed(f"the run cannot start ({alive} of {count} workers in): {failures}")
        return TimeoutError(f"{alive} of {count} workers joined within {timeout:.0f} s")

    # -- durable state -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"bindings": {str(s): who for s, who in self.bindings.items()},
                "alive": sorted(self._admitted)}

    def load_state_dict(self, state: dict, iteration: int) -> None:
        self.bindings = {int(s): who for s, who in state["bindings"].items()}
        self.expected = set(state["alive"])
        self.resumed_from = iteration
        self.iteration = iteration

    def _notify(self) -> None:
        self.changed.set()
