"""MD-GAN's swap rounds (Algorithm 1, line 11): every S iterations each active worker sends its
discriminator to another along a random derangement, as a barrier (the paper's) or in the background
(--swap-lag L: sent at boundary t, installed at t + L)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Callable

from mdgan.algorithms.base import Traffic, WorkerLost, ask_all, why_lost, with_deadline
from mdgan.algorithms.mdgan.handle import SwapOrder, WorkerHandle
from mdgan.gan import derangement

log = logging.getLogger("mdgan.algorithms.mdgan.trainer")  # (the loop's: one name for what the run says)


@dataclass(frozen=True)
class SwapsAtBoundary:
    """What a boundary's swaps did: the round started there (None: none) and the workers lost to them."""
    started: int | None
    lost: int


@dataclass(frozen=True)
class SwapPlan:
    """A round's random derangement over the active workers."""
    sends: dict[str, str]  # sender -> receiver
    orders: dict[WorkerHandle, SwapOrder]  # the participants, in rank order


@dataclass
class PendingSwap:
    """A background swap round under way: its discriminators left at boundary `started` and are
    installed at boundary `install_at` (--swap-lag)."""

    swap_round: int
    started: int
    install_at: int
    plan: SwapPlan
    lost: dict[WorkerHandle, str] = field(default_factory=dict)  # lost while sending: why


class SwapRounds:
    """The run's swap rounds: their count, the discriminators refused, the background round under way."""

    def __init__(self, seed: int, membership, traffic: Traffic, swap_timeout: float | None, swap_lag: int = 0,
                 on_swap: Callable[[dict], None] | None = None):
        self.seed = seed
        self.membership = membership
        self.traffic = traffic
        self.swap_timeout = swap_timeout
        # --swap-lag L: a round's discriminators travel during L iterations (docs/WIDE_AREA.md); 0: a barrier
        self.swap_lag = swap_lag
        self.on_swap = on_swap
        self.swaps = 0
        self.swaps_refused = 0  # discriminators a receiver's check refused (swapcheck.py)
        self.pending: PendingSwap | None = None  # the background round under way

    def participants(self) -> list[WorkerHandle]:
        """Who swaps: the members holding a discriminator of the run (not one still waiting for its copy)."""
        return [w for w in self.membership.roster.members() if not w.needs_copy]

    def plan(self, swap_round: int) -> SwapPlan:
        """The round's random derangement over the participants (two at least), and each one's order."""
        participants = self.participants()
        sends = derangement([w.worker_id for w in participants], self.seed, swap_round)
        receive_from = {dst: src for src, dst in sends.items()}
        return SwapPlan(sends, {w: SwapOrder(swap_round, sends[w.worker_id], receive_from[w.worker_id])
                                for w in participants})

    async def ask(self, orders: dict[WorkerHandle, SwapOrder], call, swap_round: int):
        """call(worker, its order) for every participant, each within the swap deadline; a worker lost
        meanwhile has its two peers told at once (the one that waits for its discriminator, and the one
        that pushes to it), each of which would otherwise spend a whole deadline on it."""
        by_id = {w.worker_id: w for w in orders}

        async def one(worker: WorkerHandle):
            order = orders[worker]
            try:
                return await with_deadline(call(worker, order), self.swap_timeout)
            except (WorkerLost, asyncio.TimeoutError) as exc:
                await self.tell_peers(by_id, order, worker.worker_id, why_lost(exc, "deadline"))
                raise

        return await ask_all(list(orders), one, None)

    @staticmethod
    async def tell_peers(by_id: dict[str, WorkerHandle], order: SwapOrder, left: str, why: str) -> None:
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

    async def record(self, swap_round: int, t: int, plan: SwapPlan, reports,
                      gone: dict[WorkerHandle, str] | None = None, installed: int | None = None) -> int:
        """Count and record a finished round (swaps.jsonl); `gone`: participants lost before it ended
        (counted as lost already), with why. The workers lost in `reports`."""
        outcome, lost = {}, 0
        for worker, report in reports.good:
            self.traffic.payload_bytes["worker_to_worker"] += report.sent_bytes
            outcome[worker.worker_id] = {"sent": report.sent, "received": report.received,
                                         "sent_bytes": report.sent_bytes, "error": report.error,
                                         **({"refused": report.refused} if report.refused else {}),
                                         **({"relayed_bytes": report.relayed_bytes} if report.relayed_bytes else {})}
            self.swaps_refused += bool(report.refused)
            if not (report.sent and report.received):
                log.warning("swap %d: %s sent=%s received=%s %s", swap_round, worker.worker_id,
                            report.sent, report.received, report.error)
        for worker, why in (gone or {}).items():
            outcome[worker.worker_id] = {"sent": False, "received": False, "sent_bytes": 0, "error": why}
        for worker, error in reports.lost:
            outcome[worker.worker_id] = {"sent": False, "received": False, "sent_bytes": 0,
                                         "error": why_lost(error, "missed its swap deadline")}
            lost += await self.membership.lose(worker, why_lost(error, "missed its swap deadline"))
        outcome = {w.worker_id: outcome[w.worker_id] for w in plan.orders if w.worker_id in outcome}  # rank order
        if self.on_swap is not None:
            self.on_swap({"round": swap_round, "iteration": t, **({"installed": installed} if installed else {}),
                          "plan": plan.sends, "workers": outcome})
        return lost

    async def swap(self, t: int) -> SwapsAtBoundary:
        """One swap round over the active workers, along a random derangement, as a barrier (the paper's):
        every worker sends its D and installs its peer's before iteration t + 1."""
        swap_round = self.swaps + 1
        plan = self.plan(swap_round)
        reports = await self.ask(plan.orders, lambda w, order: w.swap(order), swap_round)
        self.swaps = swap_round
        return SwapsAtBoundary(swap_round, await self.record(swap_round, t, plan, reports))

    async def begin_swap(self, t: int) -> SwapsAtBoundary:
        """A background round (--swap-lag L): every participant snapshots its D at boundary t and sends it
        while training goes on; finish_swap installs them at boundary t + L."""
        swap_round = self.swaps + 1
        plan = self.plan(swap_round)
        sent = await self.ask(plan.orders, lambda w, order: w.send_swap(order), swap_round)
        pending = PendingSwap(swap_round, t, t + self.swap_lag, plan)
        lost = 0
        for worker, error in sent.lost:
            pending.lost[worker] = why_lost(error, "missed its swap deadline")
            lost += await self.membership.lose(worker, pending.lost[worker])
        self.swaps, self.pending = swap_round, pending
        return SwapsAtBoundary(swap_round, lost)

    async def finish_swap(self, t: int) -> int:
        """Install the background round's discriminators at boundary t (its install_at, or earlier when
        the run stops): every participant still in takes its peer's D, waiting only for one that has
        not arrived. The workers lost."""
        pending, self.pending = self.pending, None
        members = set(self.membership.roster.members())
        by_id = {w.worker_id: w for w in pending.plan.orders}
        installing = {}
        for worker, order in pending.plan.orders.items():
            if worker in pending.lost:
                continue
            if worker not in members:  # left since: whatever it sent may have arrived; nothing more will
                pending.lost[worker] = "left during the swap round"
                await self.tell_peers(by_id, order, worker.worker_id, pending.lost[worker])
                continue
            installing[worker] = order
        reports = await self.ask(installing, lambda w, order: w.install_swap(order), pending.swap_round)
        return await self.record(pending.swap_round, pending.started, pending.plan, reports, pending.lost,
                                  installed=t)
