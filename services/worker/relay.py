"""A relayed site's side of the relay (services/server/relay.py): its discriminators come down a
stream it dialled out to the server, each push sealed end to end by its sender
(services/common/sealing.py), and go to the Peer service's own receiving code as if pushed directly;
and the push of a discriminator to a relayed site, sealed for it."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import grpc

from services.common import sealing
from services.common.proto import peer_pb2, peer_pb2_grpc
from services.worker.peer import stream_push

if TYPE_CHECKING:
    from services.common.tls import TLSConfig
    from services.worker.peer import PeerServicer

log = logging.getLogger("mdgan.worker")
ABANDONED, ENDED = object(), object()  # what a push's queue gets when its sender gave up, or stopped sending
RELAY_SERVICE = peer_pb2.DESCRIPTOR.services_by_name["Relay"].full_name


class RelayedRefusal(grpc.aio.AbortError):
    """How a relayed push is refused: the status goes back up the relay to its sender."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class RelayedCall:
    """The call context the Peer service's receiving code answers a relayed push through: the sender is the
    name in the certificate its seal opened with."""

    def __init__(self, sender_identity: str, swap_round: int):
        self.sender_identity = sender_identity
        self._peer = f"relay (from {sender_identity}, round {swap_round})"

    def peer(self) -> str:
        return self._peer

    async def abort(self, code: grpc.StatusCode, details: str):
        raise RelayedRefusal(code, details)


class RelayInbox:
    """This site's attachment to the relay, for one session with the server: every push that comes down is
    opened and handed to the Peer service, and its answer goes back up."""

    def __init__(self, servicer: PeerServicer, tls: TLSConfig, own_identity: str, chunk_timeout: float):
        self.servicer, self.tls, self.identity = servicer, tls, own_identity
        self.chunk_timeout = chunk_timeout
        self._pushes: dict[int, asyncio.Queue] = {}
        self._tasks: set[asyncio.Task] = set()
        self._write = asyncio.Lock()

    async def run(self, channel: grpc.aio.Channel) -> None:
        """Attached until the session ends (cancelled) or the relay ends the stream (then raised)."""
        call = peer_pb2_grpc.RelayStub(channel).Attach()
        try:
            await call.write(peer_pb2.RelayUp(attach=peer_pb2.RelayAttach()))
            log.info("attached to the server's relay: this site's discriminators come through it")
            async for down in call:
                queue = self._pushes.get(down.push)
                if down.abandoned or down.ended:
                    if queue is not None:
                        queue.put_nowait(ABANDONED if down.abandoned else ENDED)
                    continue
                if queue is None:
                    if down.chunk.WhichOneof("body") != "header":
                        continue  # (the rest of a push already answered)
                    queue = self._pushes[down.push] = asyncio.Queue()
                    task = asyncio.create_task(self._receive(call, down.push, down.chunk.header, queue))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                    continue
                queue.put_nowait(down.chunk)
        finally:
            for task in list(self._tasks):
                task.cancel()
            call.cancel()

    async def _receive(self, call, number: int, header: peer_pb2.RelayHeader, queue: asyncio.Queue) -> None:
        try:
            code, details, received = await self._open_and_receive(header, queue)
        finally:
            self._pushes.pop(number, None)
        if code is None:  # the sender gave up: nobody waits for an answer
            return
        async with self._write:
            try:
                await call.write(peer_pb2.RelayUp(result=peer_pb2.RelayResult(
                    push=number, code=code.value[0], details=details, received_bytes=received)))
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
                pass  # the stream is gone: the sender hears UNAVAILABLE from the relay

    def _damaged(self, header: peer_pb2.RelayHeader, sender: str, why: str) -> None:
        """What the round's designated sender sent did not open on the way: the round takes nothing from it (we
        keep our own discriminator), now rather than at the swap deadline."""
        inbox = self.servicer.host.peer_inbox()
        if inbox is None:
            return
        box = inbox.copies if header.copy else inbox.mailbox
        if box.designated(header.round) == sender:
            log.warning("swap %d: %s", header.round, why)
            box.deliver(header.round, sender, None, damaged=why)

    async def _open_and_receive(self, header, queue) -> tuple[grpc.StatusCode | None, str, int]:
        try:
            sender = sealing.sender_identity(self.tls.ca, header.sender_certificate)
        except sealing.SealError as exc:
            return grpc.StatusCode.UNAUTHENTICATED, f"relayed discriminator refused: {exc}", 0
        envelope = sealing.Envelope(sender, self.identity, header.round, header.copy, header.salt)
        try:
            opener = sealing.Opener(self.tls.key, header.sender_certificate, envelope)
        except sealing.SealError as exc:
            return grpc.StatusCode.FAILED_PRECONDITION, f"relayed discriminator refused: {exc}", 0

        async def chunks():
            while not opener.finished:
                try:
                    chunk = await asyncio.wait_for(queue.get(), self.chunk_timeout)
                except asyncio.TimeoutError:
                    raise RelayedRefusal(grpc.StatusCode.DEADLINE_EXCEEDED,
                                         f"no chunk from {sender} through the relay in {self.chunk_timeout:.0f} s")
                if chunk is ABANDONED:
                    raise asyncio.CancelledError  # by its sender
                if chunk is ENDED:
                    raise RelayedRefusal(grpc.StatusCode.DATA_LOSS, f"the relayed push from {sender} ended before "
                                                                    f"its last sealed chunk ({opener.index} opened)")
                if chunk.WhichOneof("body") != "sealed":
                    raise RelayedRefusal(grpc.StatusCode.INVALID_ARGUMENT, "a second header in one relayed push")
                try:
                    inner = peer_pb2.DiscriminatorChunk.FromString(opener.open(chunk.sealed, chunk.last))
                except sealing.SealError as exc:
                    raise RelayedRefusal(grpc.StatusCode.DATA_LOSS, f"relayed discriminator refused: {exc}")
                if inner.WhichOneof("body") == "header" and (inner.header.round, inner.header.copy) != \
                        (envelope.round, envelope.copy):
                    raise RelayedRefusal(grpc.StatusCode.DATA_LOSS, "the sealed round is not the relayed one")
                yield inner

        try:
            ack = await self.servicer.receive(chunks(), RelayedCall(sender, header.round))
        except RelayedRefusal as refusal:
            if refusal.code == grpc.StatusCode.DATA_LOSS:
                self._damaged(header, sender, refusal.details)
            return refusal.code, refusal.details, 0
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():
                raise
            return None, "", 0
        return grpc.StatusCode.OK, "", ack.received_bytes


def relayed_chunks(wire_chunks: list[bytes], tls: TLSConfig, identity: str, receiver_identity: str,
                   receiver_certificate: bytes, swap_round: int, copy: bool) -> list[peer_pb2.RelayedChunk]:
    """A push to a relayed site: the header the relay routes by, then every wire chunk sealed for the receiver."""
    envelope = sealing.new_envelope(identity, receiver_identity, swap_round, copy)
    sealed = sealing.seal(wire_chunks, tls.key, receiver_certificate, envelope)
    header = peer_pb2.RelayHeader(receiver_identity=receiver_identity, sender_identity=identity, round=swap_round,
                                  copy=copy, salt=envelope.salt, sender_certificate=tls.cert)
    return [peer_pb2.RelayedChunk(header=header),
            *(peer_pb2.RelayedChunk(sealed=s, last=i == len(sealed) - 1) for i, s in enumerate(sealed))]


async def push_relayed(channel: grpc.aio.Channel, chunks: list[peer_pb2.RelayedChunk],
                       timeout: float | None) -> peer_pb2.PushAck:
    """Stream a sealed push to the relay over `channel`; ends with the receiver's answer (AioRpcError)."""
    return await stream_push(peer_pb2_grpc.RelayStub(channel).Push(timeout=timeout), chunks)

