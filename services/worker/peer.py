"""MD-GAN's peer-to-peer part of a worker: the Peer service that receives discriminators, the
mailboxes it delivers them into (swap rounds, and copies for late joiners), and the push."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import grpc
import torch

from mdgan import compression
from mdgan.gan import DiscriminatorSide
from services.common import codec, rpc
from services.common.proto import peer_pb2, peer_pb2_grpc
from services.common.tls import peer_identity
from mdgan.algorithms.mdgan.swapcheck import check_incoming

if TYPE_CHECKING:
    from services.worker.context import PeerHost

log = logging.getLogger("mdgan.worker")
PEER_SERVICE = peer_pb2.DESCRIPTOR.services_by_name["Peer"].full_name


class SwapMailbox:
    """Discriminators pushed by peers, kept until this worker's own swap order says whom to take one from.

    Each round's order names the one identity this worker accepts a discriminator from
    (`expect`). A push is checked against that order before it is acknowledged: anyone else gets
    PERMISSION_DENIED. A push that arrives before the order is read ahead only when its sender is a
    known member of the run; any other sender is held, unread, until the order decides. Either way
    nothing is delivered before the order has come, and then the content is checked too
    (PeerServicer, mdgan/algorithms/mdgan/swapcheck.py): what a member pushed early is judged like
    any push, so holding it lets through nothing the order and the check would not. A refused push
    closes the round's box (the receiver keeps its own D; a second push is refused as a duplicate).
    Only the two rounds after the last completed one are taken, one state per round, so nobody can
    pile up memory.
    """

    def __init__(self) -> None:
        self.completed_round = 0
        self.members: set[str] = set()  # identities of the run's workers, as far as this worker knows
        self._boxes: dict[int, asyncio.Future] = {}
        self._orders: dict[int, asyncio.Future] = {}  # round -> identity of the designated sender
        self.deferred: set[int] = set()  # background rounds (--swap-lag): checked at install, not on arrival

    def _box(self, swap_round: int) -> asyncio.Future:
        return self._boxes.setdefault(swap_round, asyncio.get_running_loop().create_future())

    def _order(self, swap_round: int) -> asyncio.Future:
        return self._orders.setdefault(swap_round, asyncio.get_running_loop().create_future())

    def check(self, swap_round: int) -> tuple[grpc.StatusCode, str] | None:
        if swap_round <= self.completed_round or swap_round > self.completed_round + 2:
            return grpc.StatusCode.FAILED_PRECONDITION, f"round {swap_round} is not expected (last {self.completed_round})"
        if self._box(swap_round).done():
            return grpc.StatusCode.ALREADY_EXISTS, f"a discriminator for round {swap_round} already arrived"
        return None

    def expect(self, swap_round: int, sender_identity: str, deferred: bool = False) -> None:
        """This worker's order for `swap_round`: take a discriminator from `sender_identity` only;
        `deferred`: a background round, whose discriminator is checked when it is installed."""
        self.members.add(sender_identity)
        if deferred:
            self.deferred.add(swap_round)
        order = self._order(swap_round)
        if not order.done():
            order.set_result(sender_identity)

    async def authorize(self, swap_round: int, identity: str, timeout: float) -> tuple[grpc.StatusCode, str] | None:
        """None when `identity` is the designated sender of `swap_round` (waiting for the order if
        it has not come yet); a refusal otherwise."""
        if swap_round <= self.completed_round:  # (its order was dropped with the round: none would ever come)
            return grpc.StatusCode.FAILED_PRECONDITION, f"round {swap_round} is over"
        order = self._order(swap_round)
        try:
            expected = await asyncio.wait_for(asyncio.shield(order), timeout)
        except asyncio.TimeoutError:
            return grpc.StatusCode.PERMISSION_DENIED, f"no swap order names {identity!r} for round {swap_round}"
        except asyncio.CancelledError:
            if order.cancelled():  # the round was closed while this push waited
                return grpc.StatusCode.FAILED_PRECONDITION, f"round {swap_round} is over"
            raise
        if identity != expected:
            return grpc.StatusCode.PERMISSION_DENIED, (f"{identity!r} is not the designated sender of round "
                                                       f"{swap_round}")
        return self.check(swap_round)

    def deliver(self, swap_round: int, sender: str, state: dict[str, torch.Tensor] | None, refused: str = "",
                damaged: str = "") -> None:
        """`state` None: the server says the sender left, or (`refused` says why) our check refused
        what the designated sender pushed, or (`damaged` says why) what came from it through the relay
        did not open; either way nothing more is taken this round."""
        if swap_round <= self.completed_round:
            return
        box = self._box(swap_round)
        if not box.done():
            box.set_result((sender, state, refused, damaged))

    def designated(self, swap_round: int) -> str | None:
        """The identity this round's order names as its sender (None: no order yet, or the round is over)."""
        order = self._orders.get(swap_round)
        return order.result() if order is not None and order.done() and not order.cancelled() else None

    async def collect(self, swap_round: int, timeout: float):
        """(sender, state or None, why our check refused it or "", why it arrived damaged or "") of
        `swap_round`."""
        try:
            return await asyncio.wait_for(self._box(swap_round), timeout)
        finally:
            self.completed_round = max(self.completed_round, swap_round)
            self.deferred = {r for r in self.deferred if r > self.completed_round}
            for book in (self._boxes, self._orders):
                for r in [r for r in book if r <= self.completed_round]:
                    future = book.pop(r)
                    if not future.done():
                        future.cancel()


class CopyMailbox(SwapMailbox):
    """The copy of a live peer's discriminator that a late joiner waits for (rounds are iteration
    boundaries). Taken only while this worker waits for one, and at most two rounds at a time."""

    def __init__(self) -> None:
        super().__init__()
        self.awaiting = False

    def check(self, swap_round: int) -> tuple[grpc.StatusCode, str] | None:
        if not self.awaiting:
            return grpc.StatusCode.FAILED_PRECONDITION, "this worker is not waiting for a discriminator copy"
        if swap_round <= self.completed_round:
            return grpc.StatusCode.FAILED_PRECONDITION, f"copy for boundary {swap_round} is too old"
        if swap_round not in self._boxes and len(self._boxes) >= 2:
            return grpc.StatusCode.RESOURCE_EXHAUSTED, "copies for two boundaries are already waiting"
        if self._box(swap_round).done():
            return grpc.StatusCode.ALREADY_EXISTS, f"a copy for boundary {swap_round} already arrived"
        return None


def _chunk_wire(chunk: peer_pb2.DiscriminatorChunk | bytes) -> bytes:
    """A chunk as it travels: a message is serialized, bytes are already (codec.wire_state_chunks)."""
    return chunk if isinstance(chunk, bytes) else chunk.SerializeToString()


async def push_discriminator(channel: grpc.aio.Channel, chunks: list[peer_pb2.DiscriminatorChunk | bytes],
                             timeout: float | None) -> peer_pb2.PushAck:
    """Stream a state to a peer over `channel`: chunks as messages or as their serialized bytes. A
    peer that refuses it mid-stream ends the call with its own status (INVALID_ARGUMENT, ...),
    raised here as AioRpcError, not as a broken write."""
    push = channel.stream_unary(f"/{PEER_SERVICE}/PushDiscriminator", request_serializer=_chunk_wire,
                                response_deserializer=peer_pb2.PushAck.FromString)
    return await stream_push(push(timeout=timeout), chunks)


async def stream_push(call, chunks: list) -> peer_pb2.PushAck:
    """Write every chunk on a client-streaming push call, then its answer; the receiver's own status (raised as
    AioRpcError) when it ended the call early. Cancelled: the call is cancelled too."""
    try:
        for chunk in chunks:
            await call.write(chunk)
        await call.done_writing()
    except (asyncio.InvalidStateError, grpc.aio.AioRpcError):
        # The peer ended the call while we were writing; the failed write only says "INTERNAL",
        # the call's own status (awaited below) says why.
        pass
    except asyncio.CancelledError:  # given up (a background push past its install's deadline): end the RPC too
        call.cancel()
        raise
    try:
        return await call
    except asyncio.CancelledError:
        call.cancel()
        raise


REFUSED = "discriminator refused: "  # how a receiver's check refusal starts (PERMISSION_DENIED)


class PushRefused(Exception):
    """A push that arrived whole and was refused by the receiver's swap check."""

    def __init__(self, payload: int, messages: int, details: str, relayed: int = 0):
        super().__init__(details)
        self.payload, self.messages, self.details, self.relayed = payload, messages, details, relayed


MAX_CONCURRENT_PUSHES = 8  # pushes in progress at once; more are refused (RESOURCE_EXHAUSTED)


class PeerInbox:
    """What the Peer service delivers into: the discriminator whose layout a pushed state must have,
    and the mailboxes of swap rounds and copies (the MD-GAN worker's, services/worker/algorithms/mdgan/swaps.py)."""

    side: DiscriminatorSide
    mailbox: SwapMailbox
    copies: CopyMailbox


class PeerServicer(peer_pb2_grpc.PeerServicer):
    """Receives discriminators. Under mutual TLS the sender is the name in its certificate; with
    --insecure it is the name it claims in the header. Either way it must be the sender the server
    designated for the round (see SwapMailbox)."""

    def __init__(self, host: PeerHost):
        self.host = host
        self.active = 0
        self.warnings = rpc.RateLimitedWarnings(log)

    def sender_identity(self, context: grpc.aio.ServicerContext, header: peer_pb2.DiscriminatorHeader) -> str:
        relayed = getattr(context, "sender_identity", None)  # a relayed push: its seal's certificate (relay.py)
        if relayed is not None:
            return relayed
        if self.host.tls is not None:
            return peer_identity(context) or ""
        return header.sender_identity or header.sender_worker

    async def PushDiscriminator(self, request_iterator, context: grpc.aio.ServicerContext) -> peer_pb2.PushAck:
        if self.active >= MAX_CONCURRENT_PUSHES:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many discriminator pushes at once")
        self.active += 1
        try:
            return await self._receive(request_iterator, context)
        except (grpc.aio.AbortError, grpc.aio.AioRpcError, grpc.aio.UsageError, rpc.MalformedMessage):
            raise  # a refusal of ours, or the sender's stream: not our fault
        except rpc.CallerGone as gone:  # the pusher left (its own run ended): nobody hears the refusal
            log.debug("%s", gone)
            return peer_pb2.PushAck()
        except Exception as exc:  # our own error (the check, unpacking): the pusher hears one line, we fail
            self.host.fail("receiving a discriminator", exc)
            await context.abort(grpc.StatusCode.INTERNAL, f"the receiver failed: {rpc.one_line(exc)}")
        finally:
            self.active -= 1

    async def receive(self, chunks, context) -> peer_pb2.PushAck:
        """A push that came through the relay (services/worker/relay.py RelayedCall): received as a direct
        one; a refusal is raised as the context's abort raises it."""
        from services.worker.relay import RelayedRefusal

        if self.active >= MAX_CONCURRENT_PUSHES:
            raise RelayedRefusal(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many discriminator pushes at once")
        self.active += 1
        try:
            return await self._receive(chunks, context)
        except (RelayedRefusal, asyncio.CancelledError):
            raise
        except Exception as exc:  # our own error (the check, unpacking): the pusher hears one line, we fail
            self.host.fail("receiving a relayed discriminator", exc)
            raise RelayedRefusal(grpc.StatusCode.INTERNAL, f"the receiver failed: {rpc.one_line(exc)}") from None
        finally:
            self.active -= 1

    async def _receive(self, request_iterator, context: grpc.aio.ServicerContext) -> peer_pb2.PushAck:
        host = self.host
        inbox = host.peer_inbox()  # None: not in an MD-GAN run
        side, telemetry = (inbox.side if inbox else None), host.telemetry
        mailbox = inbox.mailbox if inbox else None  # the header's `copy` picks the copies' instead
        keeps = side is not None and side.config.privacy.keeps_discriminators  # private feedback: none comes in
        assembler = codec.StateAssembler(compression.wire_layout(side.state_layout(), side.config.wire_dtype)) \
            if side is not None and not keeps else None
        # Refusing mid-stream while the peer still writes can surface as INTERNAL on its side, so a
        # refused stream is drained (up to a bound, discarding) and refused once the peer is done.
        refusal: tuple[grpc.StatusCode, str] | None = None
        if side is None:
            refusal = grpc.StatusCode.FAILED_PRECONDITION, "this worker has not joined a run yet"
        elif keeps:
            refusal = (grpc.StatusCode.FAILED_PRECONDITION,
                       "this site takes no discriminators in (--dp-mechanism feedback: none leaves its site)")
        drain_limit = 2 * (assembler.expected_bytes() if assembler else codec.CHUNK_BYTES) + codec.CHUNK_BYTES
        discarded = 0
        sender, authorized = "", False
        async for chunk in request_iterator:
            # Read a data chunk's bytes once: each access of chunk.data copies up to a megabyte, and
            # so would ByteSize() (upb serializes to measure).
            data = chunk.data if chunk.WhichOneof("body") == "data" else None
            size = 0 if data is None else len(data)
            telemetry.count("worker_to_worker", "discriminator", "receiver", chunk, size,
                            None if data is None else codec.data_chunk_bytes(size))
            if refusal is not None:
                discarded += size
                if discarded > drain_limit:
                    break
                continue
            try:
                if assembler.header is None:
                    if chunk.WhichOneof("body") != "header":
                        raise codec.InvalidTensor("protocol", "the first chunk must be the header")
                    mailbox = inbox.copies if chunk.header.copy else inbox.mailbox
                    refusal = mailbox.check(chunk.header.round)
                    if refusal is not None:
                        continue
                    assembler.accept(chunk)
                    sender = self.sender_identity(context, chunk.header)
                    if sender not in mailbox.members:  # not known to be in the run: read nothing before the order
                        refusal = await mailbox.authorize(chunk.header.round, sender, host.swap_timeout)
                        authorized = refusal is None
                    continue
                if data is not None:
                    assembler.accept_data(data)
                else:
                    assembler.accept(chunk)
            except codec.InvalidTensor as exc:
                telemetry.rejected.labels(exc.reason).inc()
                refusal = grpc.StatusCode.INVALID_ARGUMENT, str(exc)
        if refusal is None:
            try:
                state = assembler.finish()
            except codec.InvalidTensor as exc:
                telemetry.rejected.labels(exc.reason).inc()
                refusal = grpc.StatusCode.INVALID_ARGUMENT, str(exc)
        if refusal is None and not authorized:  # a member read ahead: now the order decides
            refusal = await mailbox.authorize(assembler.header.round, sender, host.swap_timeout)
        if refusal is not None:
            if refusal[0] == grpc.StatusCode.PERMISSION_DENIED:
                telemetry.rejected.labels("sender").inc()
            self.warnings.warn(refusal[0].name, "refused a discriminator from %s (%s): %s", sender or "?",
                               context.peer(), refusal[1])
            await rpc.refuse(context, *refusal)
        try:
            state = compression.unpack_state(state, side.state_layout(), side.config.wire_dtype)
        except compression.PackingError as exc:
            telemetry.rejected.labels(exc.reason).inc()
            log.warning("refused a discriminator from %s: %s", context.peer(), exc)
            await rpc.refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        check = getattr(inbox, "swap_check", None)
        if mailbox is inbox.mailbox and check is not None and check.enabled and assembler.header.round not in mailbox.deferred:
            # after the order (authorize above): our D is the one of this round's boundary, as in simulate
            # (a background round's is judged when it is installed, against our D then: the worker's _take)
            verdict = check_incoming(side, state, check)
            if verdict.refused:
                telemetry.rejected.labels("discriminator").inc()
                log.warning("swap %d: refused the discriminator from %s: %s", assembler.header.round, sender,
                            verdict.refused)
                mailbox.deliver(assembler.header.round, sender, None, refused=verdict.refused)
                await rpc.refuse(context, grpc.StatusCode.PERMISSION_DENIED, REFUSED + verdict.refused)
        mailbox.deliver(assembler.header.round, sender, state)
        return peer_pb2.PushAck(received_bytes=assembler.header.total_bytes)
