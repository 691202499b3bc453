"""Who takes part in an MD-GAN run: the roster asked at each boundary, workers dropped when lost, the
pause when too few are left, and late joiners given a copy of a live peer's discriminator."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from mdgan.algorithms.base import Traffic, WorkerLost, sort_replies, tell_to_stop, why_lost, with_deadline
from mdgan.algorithms.mdgan.handle import COPY, SwapOrder, SwapReport, WorkerHandle
from mdgan.roster import Roster

log = logging.getLogger("mdgan.algorithms.mdgan.trainer")  # (the loop's: one name for what the run says)


class Membership:
    """The run's members (a Roster) and what happens when one leaves or arrives."""

    def __init__(self, roster: Roster, traffic: Traffic, swap_timeout: float | None,
                 on_swap: Callable[[dict], None] | None = None):
        self.roster = roster
        self.traffic = traffic
        self.swap_timeout = swap_timeout
        self.on_swap = on_swap
        # The last copy order's number. A worker's copy mailbox takes each number once, so a copy tried
        # again at the same boundary (its donor left) needs a new one: with the boundary's own number
        # again, the joiner refused every later copy as too old, and the run stood at that boundary.
        self._copy_round = 0
        self._counted_lost: set[WorkerHandle] = set()  # handles whose loss an iteration record counted

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

    async def drop(self, worker: WorkerHandle, why: str) -> None:
        if self.roster.depart(worker):
            log.warning("dropping %s: %s", worker.worker_id, why)
            await tell_to_stop(worker, why)

    async def lose(self, worker: WorkerHandle, why: str) -> int:
        """Drop a worker found lost; 1 the first time its loss is seen, 0 after. Under async its step
        can still be out when a swap loses it, and both see the same loss. (The transport may have
        taken it off the roster already: being off the roster does not say it was counted.)"""
        first = worker not in self._counted_lost
        self._counted_lost.add(worker)
        await self.drop(worker, why)
        return int(first)

    async def pause(self, t: int) -> bool:
        """Fewer than the quorum alive: wait for workers to come back; False when giving up."""
        roster = self.roster
        timeout = roster.pause_timeout
        log.warning("paused after iteration %d: %d workers alive, %d needed; waiting %s", t, len(roster.alive()),
                    roster.keep_quorum, "indefinitely" if timeout is None else f"up to {timeout:.0f} s")
        if not timeout and timeout is not None:
            return len(roster.alive()) >= roster.keep_quorum
        return await roster.wait_for(roster.keep_quorum, timeout)

    async def admit(self, newcomers: list[WorkerHandle], t: int) -> None:
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
                await self.drop(worker, why_lost(error, "missed its copy deadline"))
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
