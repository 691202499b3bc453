"""MD-GAN swaps and copies on a worker: a swap order pushes our D to a peer (push.py) and takes the
peer's from the mailbox the Peer service delivers into; a background round (--swap-lag) installs at its
swap_install; a copy gives ours to a late joiner or takes one; a swap_cancel calls off what waits on
a peer that left. Every round ends in one SwapReport to the server."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc
import torch

from mdgan import compression
from mdgan.algorithms.mdgan.swapcheck import SwapCheck, check_incoming
from services.common.proto import coordinator_pb2 as pb
from services.worker.algorithms.base import ServerGone, StreamBroken
from services.worker.algorithms.mdgan.push import PeerPusher, PushOutcome
from services.worker.peer import CopyMailbox, PeerInbox, PushRefused, SwapMailbox

log = logging.getLogger("mdgan.worker")


@dataclass(frozen=True)
class TakeOutcome:
    """Our peer's D: whether we installed it, and why our check refused it ("" if it did not)."""

    received: bool
    refused: str = ""


class WorkerSwaps(PeerInbox):
    """One session's swaps and copies, and the mailboxes the Peer service delivers into (PeerInbox).
    discriminator_attack: an emulated Byzantine worker's poison for the D it pushes (None: honest)."""

    def __init__(self, node, side, discriminator_attack=None, swap_check: SwapCheck = SwapCheck(),
                 completed_round: int = 0, awaiting_copy: bool = False, members=()):
        self.node = node
        self.side = side
        self.discriminator_attack = discriminator_attack
        self.swap_check = swap_check  # the run's, from the welcome's spec (or this site's own --swap-check)
        self.mailbox = SwapMailbox()
        self.mailbox.completed_round = completed_round
        self.mailbox.members.update(members)
        self.copies = CopyMailbox()
        self.copies.awaiting = awaiting_copy
        self.pusher = PeerPusher(node)
        self.tasks: set[asyncio.Task] = set()  # swaps under way (a swap_cancel may come meanwhile)
        self._background: dict[int, tuple] = {}  # background round -> (its order, our push, when it began)
        self._pushes: dict[int, asyncio.Task] = {}  # swap round -> our push under way
        self._receiver_left: dict[int, str] = {}  # swap round -> why our push was called off

    async def end(self) -> None:
        """The session ended: nothing under way goes on, and no channel stays open."""
        for task in self.tasks:
            task.cancel()
        self.tasks.clear()
        self._background.clear()
        self._pushes.clear()
        self._receiver_left.clear()
        await self.pusher.close()

    async def on_order(self, call, order: pb.SwapOrder) -> None:
        if self.side.config.privacy.keeps_discriminators:
            raise ServerGone(f"the server ordered a {order.kind or 'swap'} (round {order.round}), but this site's "
                             "discriminators never leave it and it takes none in (--dp-mechanism feedback)")
        # Known before anything else happens: pushes for this round (or this copy) are checked against it.
        box = self.copies if order.kind == "copy" else self.mailbox
        if order.receive_from_identity or order.receive_from_worker:
            box.expect(order.round, order.receive_from_identity or order.receive_from_worker,
                       deferred=order.deferred and order.kind != "copy")
        if order.send_to_identity:
            self.mailbox.members.add(order.send_to_identity)
        self.tasks.difference_update([t for t in self.tasks if t.done()])
        if order.deferred and order.kind != "copy":
            self._begin_background(order)  # reported at its swap_install
            return
        # In the background: a swap_cancel may arrive while we wait for a peer.
        self.tasks.add(asyncio.create_task(self._report_when_done(call, order.round, self._swap(order))))

    async def on_install(self, call, install: pb.SwapInstall) -> None:
        # In the background too: a swap_cancel may arrive while we wait for the peer's discriminator.
        self.tasks.add(asyncio.create_task(self._report_when_done(call, install.round, self._install(install))))

    async def on_cancel(self, call, cancel: pb.SwapCancel) -> None:
        if cancel.receiver_worker:  # the peer we push to left: our push would retry it until the deadline
            log.warning("swap %d: %s, whom we push to, left (%s)", cancel.round, cancel.receiver_worker, cancel.reason)
            push = self._pushes.get(cancel.round)
            if push is not None and not push.done():
                self._receiver_left[cancel.round] = f"{cancel.receiver_worker} left ({cancel.reason})"
                push.cancel()
            return
        log.warning("%s %d: %s left (%s)", "copy" if cancel.copy else "swap", cancel.round, cancel.sender_worker,
                    cancel.reason)
        (self.copies if cancel.copy else self.mailbox).deliver(cancel.round, cancel.sender_worker, None)

    async def _report_when_done(self, call, swap_round: int, swapping) -> None:
        try:
            report = await swapping
        except Exception as exc:  # our own error while swapping: the worker fails (in a task nobody awaits)
            self.node.fail(f"swapping (round {swap_round})", exc)
            return
        try:
            await self.node.write(call, pb.WorkerMessage(swap_report=report))
        except (StreamBroken, grpc.aio.AioRpcError, grpc.aio.UsageError) as exc:
            # The stream ended while we swapped (a swap takes up to the swap deadline): the read loop
            # finds that out and reconnects.
            log.info("swap %d: the report was not sent (%s)", swap_round, exc)

    async def _copy(self, order: pb.SwapOrder) -> pb.SwapReport:
        """A one-way copy for a late joiner: we give ours (send_to set) or take one (receive_from set)."""
        if order.send_to_worker:
            try:
                state = compression.pack_state(self.side.export_state(), self.side.config.wire_dtype)
                pushed = await self.pusher.push(order, state, copy=True)
                return pb.SwapReport(round=order.round, sent=True, sent_payload_bytes=pushed.payload_bytes,
                                     sent_message_bytes=pushed.message_bytes)
            except (grpc.aio.AioRpcError, asyncio.TimeoutError) as exc:
                detail = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else "timeout"
                return pb.SwapReport(round=order.round, error=f"copy to {order.send_to_worker} failed: {detail}")
        try:
            sender, incoming, _, damaged = await self.copies.collect(order.round, self.node.swap_timeout)
        except asyncio.TimeoutError:
            return pb.SwapReport(round=order.round, error=f"no copy from {order.receive_from_worker}")
        if incoming is None:
            return pb.SwapReport(round=order.round, error=damaged or f"no copy from {order.receive_from_worker}: the "
                                                                     "server called it off (the donor left, or its push "
                                                                     "failed)")
        if sender != (order.receive_from_identity or order.receive_from_worker):
            return pb.SwapReport(round=order.round, error=f"expected a copy from {order.receive_from_worker}, got {sender}")
        self.side.adopt(incoming)
        self.copies.awaiting = False
        log.info("took a copy of %s's discriminator", sender)
        return pb.SwapReport(round=order.round, received=True)

    async def _swap(self, order: pb.SwapOrder) -> pb.SwapReport:
        """The paper's swap: push ours, take the peer's and install it, within the swap deadline."""
        if order.kind == "copy":
            return await self._copy(order)
        started = time.perf_counter()
        # Ours goes out while we wait for our peer's: a round takes one swap deadline at most, not a push
        # deadline and then a wait deadline that began only after it (docs/WIDE_AREA.md).
        push = self._pushes[order.round] = asyncio.ensure_future(self._send(order, self._snapshot()))
        errors: list[str] = []
        try:
            taken = await self._take(order, errors)
        except BaseException:
            push.cancel()
            raise
        pushed = await push
        self._pushes.pop(order.round, None)
        return self._report(order, started, pushed, taken, errors)

    def _snapshot(self) -> dict[str, torch.Tensor]:
        """Our D as it leaves, in its wire form (taken before anything arrives in its place)."""
        exported = self.side.export_state()
        if self.discriminator_attack is not None:  # an emulated Byzantine worker pushes a poisoned D
            exported = self.discriminator_attack(exported)
        return compression.pack_state(exported, self.side.config.wire_dtype)

    def _begin_background(self, order: pb.SwapOrder) -> None:
        """A background round (--swap-lag): the snapshot now, in the order's handler, before the next
        batches are read (the same boundary as in simulate); the push goes on while we train."""
        push = self._pushes[order.round] = asyncio.create_task(self._send(order, self._snapshot(), deadline=False))
        self.tasks.add(push)
        self._background[order.round] = (order, push, time.perf_counter())

    async def _install(self, install: pb.SwapInstall) -> pb.SwapReport:
        """A background round's boundary: install what our peer sent (waiting for it if it has not come),
        checked here, against our D as it is now (the same D and check set as simulate's)."""
        entry = self._background.pop(install.round, None)
        if entry is None:
            return pb.SwapReport(round=install.round, error=f"no background swap order for round {install.round}")
        order, push, started = entry
        self._pushes.pop(install.round, None)
        errors: list[str] = []
        installing = time.monotonic()
        taken = await self._take(order, errors, check=True)
        # Ours has had the whole lag to arrive; from the install on, one swap deadline for both (the wait
        # for our peer's and for our own push), not one after the other.
        await asyncio.wait([push], timeout=max(0.0, self.node.swap_timeout - (time.monotonic() - installing)))
        if not push.done():
            push.cancel()
            return self._report(order, started, PushOutcome(False, errors=[
                f"push to {order.send_to_worker} did not finish within {self.node.swap_timeout:.0f} s of the round's "
                "install"]), taken, errors)
        return self._report(order, started, push.result(), taken, errors)

    async def _send(self, order: pb.SwapOrder, state: dict[str, torch.Tensor],
                    deadline: bool = True) -> PushOutcome:
        """Push `state` to order.send_to; raises only when cancelled for another reason than its receiver's
        departure."""
        try:
            return await self.pusher.push(order, state, deadline=deadline)
        except asyncio.CancelledError:
            why = self._receiver_left.pop(order.round, None)
            if why is None:
                raise
            asyncio.current_task().uncancel()
            return PushOutcome(False, errors=[f"push to {order.send_to_worker} called off: {why}"])
        except PushRefused as exc:  # sent, as in simulate; the receiver kept its own D (its report says why)
            return PushOutcome(True, exc.payload, exc.messages,
                               [f"{order.send_to_worker} refused our discriminator: {exc.details}"], exc.relayed)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError, grpc.aio.UsageError) as exc:
            detail = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else repr(exc)
            return PushOutcome(False, errors=[f"push to {order.send_to_worker} failed: {detail}"])

    async def _take(self, order: pb.SwapOrder, errors: list[str], check: bool = False) -> TakeOutcome:
        """Install the D our peer pushed for order.round, adding to `errors` what went wrong.
        `check`: judge it here (a background round; otherwise the Peer service judged it on arrival)."""
        swap_timeout = self.node.swap_timeout
        try:
            sender, incoming, refused, damaged = await self.mailbox.collect(order.round, swap_timeout)
        except asyncio.TimeoutError:
            errors.append(f"no discriminator from {order.receive_from_worker} within {swap_timeout:.0f} s")
            return TakeOutcome(False)
        expected = order.receive_from_identity or order.receive_from_worker
        if refused:  # our check refused what it pushed (PeerServicer): we keep our own D this round
            errors.append(f"refused the discriminator from {sender}: {refused}")
            return TakeOutcome(False, refused)
        if damaged:  # it came through the relay and did not open: we keep our own D this round
            errors.append(damaged)
            return TakeOutcome(False)
        if incoming is None:
            errors.append(f"{sender} left before sending its discriminator")
            return TakeOutcome(False)
        if sender != expected:
            errors.append(f"expected a discriminator from {order.receive_from_worker}, got {sender}")
            return TakeOutcome(False)
        if check and self.swap_check.enabled:
            verdict = check_incoming(self.side, incoming, self.swap_check)
            if verdict.refused:
                self.node.telemetry.rejected.labels("discriminator").inc()
                errors.append(f"refused the discriminator from {sender}: {verdict.refused}")
                return TakeOutcome(False, verdict.refused)
        self.side.import_state(incoming)
        return TakeOutcome(True)

    def _report(self, order, started: float, pushed: PushOutcome, taken: TakeOutcome,
                errors: list[str]) -> pb.SwapReport:
        """The round's report: the push's errors first, then the take's."""
        errors = pushed.errors + errors
        sent, received = pushed.sent, taken.received
        for e in errors:
            log.warning("swap %d: %s", order.round, e)
        telemetry = self.node.telemetry
        telemetry.swaps.labels("complete" if sent and received else "incomplete").inc()
        telemetry.phase_seconds.labels("swap").observe(time.perf_counter() - started)
        return pb.SwapReport(round=order.round, sent=sent, received=received, sent_payload_bytes=pushed.payload_bytes,
                             sent_message_bytes=pushed.message_bytes, error="; ".join(errors), refused=taken.refused,
                             relayed_bytes=pushed.relayed_bytes)
