"""MD-GAN on a worker: a discriminator on the local shard. Takes batches (answers feedback), swap
orders and cancels (pushes its D to a peer over the Peer service, takes one from its mailbox),
copies for late joiners, checkpoint orders; emulates a Byzantine worker or a straggler on demand."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field

import grpc
import torch

from mdgan import compression
from mdgan.algorithms.mdgan.private_feedback import worker_side
from mdgan.algorithms.mdgan.swapcheck import SwapCheck, check_incoming
from mdgan.attacks import make_attacks
from mdgan.config import ConfigError
from mdgan.config import TrainingConfig
from mdgan.data import Shard
from mdgan.gan import WorkerBatch
from mdgan import privacy
from mdgan.step_results import STATS, read_stats
from services.common import codec, rpc, tls as tls_
from services.common.proto import coordinator_pb2 as pb
from services.common import wire as wire_traffic
from services.worker.algorithms.base import BudgetSpent, ServerGone, StreamBroken, WorkerAlgorithm
from services.worker.relay import push_relayed, relayed_chunks
from services.worker.peer import REFUSED, CopyMailbox, PeerInbox, PushRefused, SwapMailbox, push_discriminator

log = logging.getLogger("mdgan.worker")


def wire_stats(result) -> pb.StepStats:
    """What a step's StepStats carry: its released statistics (a withheld one, NaN, is left out: 0 on the wire), and
    what the site has spent (epsilon, delta; 0 and 0 when not private) and whether its noise was fixed."""
    stats = {name: value for name in STATS if math.isfinite(value := getattr(result, name))}
    if math.isfinite(result.delta):
        stats.update(epsilon=result.epsilon, delta=result.delta, fixed_noise=result.fixed_noise)
    return pb.StepStats(**stats)


@dataclass(frozen=True)
class PushOutcome:
    """Our D's push to our peer: whether it crossed whole, its bytes (tensor payload, wire messages), and what
    went wrong (a push refused by its receiver's check still counts as sent)."""

    sent: bool
    payload_bytes: int = 0
    message_bytes: int = 0
    errors: list[str] = field(default_factory=list)
    relayed_bytes: int = 0  # sealed bytes sent through the server's relay (0: pushed direct)


@dataclass(frozen=True)
class TakeOutcome:
    """Our peer's D: whether we installed it, and why our check refused it ("" if it did not)."""

    received: bool
    refused: str = ""


class MDGANWorker(WorkerAlgorithm, PeerInbox):
    name = "mdgan"

    def __init__(self, node, config: TrainingConfig, shard: Shard):
        super().__init__(node, config, shard)
        self.side = worker_side(config, shard, node.privacy_ledger(config))
        if self.side.private is not None:
            site = self.side.private.site
            cap = privacy.budget(site, node.policy.dp_max_epsilon)
            log.info("differentially private (%s, %d discriminator%s): sigma %.4g, C %g, q %.4g, delta %g, budget %s; "
                     "spent so far %.4g; withheld from the server: %s", site.mechanism, site.discriminators,
                     "s" if site.discriminators > 1 else "", site.noise_multiplier, site.max_grad_norm,
                     site.sample_rate, site.delta, f"{cap:g}" if math.isfinite(cap) else "none",
                     self.side.private.epsilon(), ", ".join(privacy.withheld_stats(config.privacy)))
        # Emulation for experiments (mdgan-worker --attack, --slow-factor): a Byzantine worker, a straggler.
        self.attack, self.discriminator_attack = make_attacks(node.policy.attack, config.seed, shard.index)
        if node.policy.attack:
            log.warning("emulating a Byzantine worker: %s %s", node.policy.attack,
                        "discriminators" if self.discriminator_attack else "feedback")
        self.swap_check = SwapCheck()  # the run's, from the welcome's spec (or this site's own --swap-check)
        self.slow_factor = node.policy.slow_factor
        self.mailbox = SwapMailbox()
        self.copies = CopyMailbox()
        self._peer_channels: dict[tuple[str, str], grpc.aio.Channel] = {}
        self._swaps: set[asyncio.Task] = set()  # swaps under way (a swap_cancel may come meanwhile)
        self._background: dict[int, tuple] = {}  # background round -> (its order, our push, when it began)
        self._pushes: dict[int, asyncio.Task] = {}  # swap round -> our push under way
        self._receiver_left: dict[int, str] = {}  # swap round -> why our push was called off

    def final_discriminator(self) -> dict:
        return self.side.discriminator.state_dict()

    def continues(self, config: TrainingConfig) -> bool:
        return self.side.config == config  # back in the same run: keep our discriminator

    async def welcome(self, welcome: pb.Welcome) -> None:
        """The swap rounds done, our own saved state or a copy to wait for."""
        node = self.node
        try:
            self.swap_check = codec.options_from_spec(welcome.spec, "mdgan",
                                                      swap_check=node.policy.swap_check).as_check()
        except ConfigError as exc:
            raise ServerGone(f"the server's swap check settings are invalid: {exc}") from exc
        self.mailbox = SwapMailbox()
        self.mailbox.completed_round = welcome.swap_round
        self.copies = CopyMailbox()
        self.copies.awaiting = welcome.copy
        self.mailbox.members.update(welcome.members)
        node.remember_run()
        if welcome.restore_iteration:
            store = node.store()
            if store is None:
                raise ServerGone(f"asked to restore iteration {welcome.restore_iteration} but keeping no state")
            state = await asyncio.to_thread(store.load, welcome.restore_iteration, "worker")
            self.side.load_state_dict(state)
            self.trained_iteration = welcome.restore_iteration
            log.info("restored our state of iteration %d", welcome.restore_iteration)
        elif welcome.copy:
            log.info("waiting for a copy of a live peer's discriminator")

    def receivers(self):
        return {"batches": self._on_batches, "checkpoint": self._on_checkpoint,
                "swap_order": self._on_swap_order, "swap_install": self._on_swap_install,
                "swap_cancel": self._on_swap_cancel}

    traffic = staticmethod(wire_traffic.mdgan)  # (kind, payload bytes) of its messages, as both sides count them

    async def end_session(self) -> None:
        for task in self._swaps:
            task.cancel()
        self._swaps.clear()
        self._background.clear()
        self._pushes.clear()
        self._receiver_left.clear()
        channels, self._peer_channels = self._peer_channels, {}  # a later session opens its own
        for channel in channels.values():
            await channel.close()

    # -- batches -> feedback -----------------------------------------------------------------
    async def _on_batches(self, call, batches: pb.Batches) -> None:
        config = self.side.config
        shape = (config.batch_size, *config.model.sample_shape)
        classes, conditional = config.model.num_classes, config.model.conditional
        wire = config.wire_dtype
        try:  # the server's input is checked like anyone's
            batch = WorkerBatch(
                generated=codec.decode_packed(batches.generated, shape=shape, wire_dtype=wire, field="generated"),
                generated_labels=codec.decode_labels(batches.generated_labels, shape[0], classes, "generated_labels")
                if conditional else None,
                discriminated=codec.decode_packed(batches.discriminated, shape=shape, wire_dtype=wire,
                                                  field="discriminated"),
                discriminated_labels=codec.decode_labels(batches.discriminated_labels, shape[0], classes,
                                                         "discriminated_labels") if conditional else None,
                generated_index=0)
        except codec.InvalidTensor as exc:
            raise ServerGone(f"the server sent an invalid batch: {exc}") from exc
        # One yield after decoding and one before writing: workers sharing a process
        # (--workers-per-process) get their batches together, so the loop then decodes them all,
        # steps them all, and encodes and writes them all, each phase's code warm in the caches,
        # instead of alternating message code and torch worker by worker: about 3% less CPU per
        # iteration at N=10 (docs/PERFORMANCE.md). No message of the server's is read
        # meanwhile (the read loop awaits this handler); what a background task does during a yield
        # (a peer's push, a late swap) is as if done before this batch (the decoded batch does not
        # depend on our D) or after this feedback (computed before the second yield).
        await asyncio.sleep(0)
        private = self.side.private
        refusal = privacy.over_budget(private, self.node.policy.dp_max_epsilon) if private is not None else None
        if refusal is not None:  # the site stops answering and leaves; the run goes on as membership says
            raise BudgetSpent(f"iteration {batches.iteration}: {refusal}")
        started = time.perf_counter()
        # On the event loop's own thread: a step takes milliseconds, and a hop to a worker thread
        # and back (two thread wake-ups per iteration) cost a measurable share of them. Peers and
        # heartbeats wait at most one step; the server sends nothing else until this feedback.
        (result,) = read_stats([self.side.step(batch)])  # (the wire carries them: one read a step)
        self.trained_iteration = batches.iteration
        if self.slow_factor > 1:  # an emulated straggler
            await asyncio.sleep((self.slow_factor - 1) * (time.perf_counter() - started))
        feedback = result.feedback if self.attack is None else self.attack(result.feedback)
        await asyncio.sleep(0)  # the other workers' steps first (above)
        await self.node.write(call, pb.WorkerMessage(feedback=pb.Feedback(
            iteration=batches.iteration, gradient=codec.encode_packed(compression.pack(feedback, wire)),
            stats=wire_stats(privacy.released(result, config.privacy)))))
        t = self.node.telemetry
        t.iterations.inc()
        t.iteration_seconds.observe(time.perf_counter() - started)
        t.phase_seconds.labels("disc_steps").observe(result.disc_seconds)
        t.phase_seconds.labels("feedback").observe(result.feedback_seconds)
        t.generator_loss.set(result.gen_loss)
        t.discriminator_loss.set(result.disc_loss)
        t.discriminator_accuracy.labels("real").set(result.real_accuracy)
        t.discriminator_accuracy.labels("generated").set(result.fake_accuracy)
        if private is not None:
            t.privacy_epsilon.set(result.epsilon)
        t.last_iteration.set_to_current_time()

    # -- checkpoints -------------------------------------------------------------------------
    async def _on_checkpoint(self, call, order: pb.CheckpointOrder) -> None:
        node, error = self.node, ""
        if not node.state_dir:
            error = "this worker keeps no state (no --state-dir)"
        elif order.run_id != node.run_id:
            error = f"checkpoint for run {order.run_id!r}, this worker is in run {node.run_id!r}"
        else:
            try:  # in a thread: the event loop goes on serving peers and heartbeats
                await asyncio.to_thread(self._save_state, order.iteration)
            except OSError as exc:
                error = f"could not write state: {exc}"
        if error:
            log.error("checkpoint %d: %s", order.iteration, error)
        await node.write(call, pb.WorkerMessage(checkpoint_done=pb.CheckpointDone(
            iteration=order.iteration, ok=not error, error=error)))

    def _save_state(self, iteration: int) -> None:
        store = self.node.store()
        store.save(iteration, "worker", self.side.state_dict())
        store.prune(marker=None)

    # -- swaps and copies --------------------------------------------------------------------
    async def _on_swap_order(self, call, order: pb.SwapOrder) -> None:
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
        self._swaps.difference_update([t for t in self._swaps if t.done()])
        if order.deferred and order.kind != "copy":
            self._begin_background(order)  # reported at its swap_install
            return
        # In the background: a swap_cancel may arrive while we wait for a peer.
        self._swaps.add(asyncio.create_task(self._report_when_done(call, order.round, self._swap(order))))

    async def _on_swap_install(self, call, install: pb.SwapInstall) -> None:
        # In the background too: a swap_cancel may arrive while we wait for the peer's discriminator.
        self._swaps.add(asyncio.create_task(self._report_when_done(call, install.round, self._install(install))))

    async def _on_swap_cancel(self, call, cancel: pb.SwapCancel) -> None:
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
                pushed = await self._push(order, state, copy=True)
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
        self._swaps.add(push)
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
            return await self._push(order, state, deadline=deadline)
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

    async def _push(self, order: pb.SwapOrder, state: dict[str, torch.Tensor], copy: bool = False,
                    deadline: bool = True) -> PushOutcome:
        """Push `state` to order.send_to. A connection that fails (UNAVAILABLE: a link down, a peer's
        channel broken) is opened afresh and the push tried again, within the swap deadline; the receiver
        installs only a state that arrived whole, so a push cut short and tried again is never half-used.
        `deadline` False: a background round's push, which has until its install (and the swap deadline
        after it) to arrive, however long the lag lasts in seconds (_install cancels it then)."""
        node = self.node
        key = (order.send_to_address, order.send_to_identity)  # another identity at one address: its own channel
        chunks = codec.wire_state_chunks(state, order.round, node.worker_id, node.identity, copy=copy)
        relayed = None
        if order.send_via_relay:  # the receiver takes no inbound connection: sealed for it, through the relay
            if node.tls is None:
                raise ConfigError("a relayed receiver needs mutual TLS here too (this worker runs --insecure)")
            relayed = relayed_chunks([wire for wire, _ in chunks], node.tls, node.identity, order.send_to_identity,
                                     order.send_to_certificate, order.round, copy)
        loop = asyncio.get_running_loop()
        give_up = loop.time() + node.swap_timeout if deadline else math.inf
        retry = 0.5
        while True:
            left = give_up - loop.time()
            if relayed is not None:
                channel = node.server_channel
                if channel is None:  # between two sessions with the server: the push waits for the next
                    if left <= retry:
                        raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                                   grpc.aio.Metadata(), "no session with the server for the relay")
                    await asyncio.sleep(retry)
                    retry = min(2 * retry, 8.0)
                    continue
            else:
                channel = self._peer_channels.get(key)
                if channel is None:
                    # The receiver is verified as the identity the server named, wherever its address points.
                    channel = self._peer_channels[key] = tls_.channel(order.send_to_address, node.tls, rpc.options(),
                                                                      order.send_to_identity or None)
            try:
                if relayed is not None:
                    await push_relayed(channel, relayed, left if deadline else None)
                else:
                    await push_discriminator(channel, [wire for wire, _ in chunks], left if deadline else None)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNAVAILABLE and left > retry:
                    log.info("swap %d: push to %s%s failed (%s); trying again in %.1f s", order.round,
                             order.send_to_worker, " through the relay" if relayed else "", exc.details(), retry)
                    if relayed is None:
                        if self._peer_channels.get(key) is channel:
                            del self._peer_channels[key]
                        await channel.close()
                    await asyncio.sleep(retry)
                    retry = min(2 * retry, 8.0)
                    continue
                if not (exc.code() == grpc.StatusCode.PERMISSION_DENIED and (exc.details() or "").startswith(REFUSED)):
                    raise
                refused = exc  # it crossed the wire whole and the receiver's check refused it: sent all the same
            else:
                refused = None
            break
        for wire, payload in chunks:
            node.telemetry.count("worker_to_worker", "discriminator", "sender", None, payload, len(wire))
        node.telemetry.swap_paths.labels("relayed" if relayed else "direct").inc()
        pushed = PushOutcome(True, sum(payload for _, payload in chunks), sum(len(wire) for wire, _ in chunks),
                             relayed_bytes=sum(len(c.sealed) for c in relayed) if relayed else 0)
        if refused is not None:
            raise PushRefused(pushed.payload_bytes, pushed.message_bytes, refused.details(), pushed.relayed_bytes)
        return pushed
