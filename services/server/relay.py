"""The relay: how a site that takes no inbound connection gets its discriminators. It attaches over
a stream it dials out (Relay.Attach); a sender pushes to the relay (Relay.Push) and the relay forwards
each chunk down the receiver's stream, then ends the push with the receiver's own answer.

What it forwards is sealed end to end between the two sites (services/common/sealing.py): the relay
routes by the header's receiver and counts bytes; it reads and changes nothing else. It runs in the
server's process, on its port: no site opens a port for it."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from typing import Callable

import grpc

from services.common import rpc
from services.common.proto import peer_pb2, peer_pb2_grpc
from services.common.telemetry import Telemetry
from services.common.tls import peer_identity

log = logging.getLogger("mdgan.relay")
RELAY_SERVICE = peer_pb2.DESCRIPTOR.services_by_name["Relay"].full_name
ATTACH_GRACE_S = 10.0  # how long a push waits for a member's relay stream that is not attached yet
QUEUE_MESSAGES = 8  # chunks in flight per attached site: a slow receiver slows its senders, not the relay's memory


class Attachment:
    """One relayed site's stream: what goes down it, and the pushes waiting for its answers."""

    def __init__(self, identity: str):
        self.identity = identity
        self.down: asyncio.Queue[peer_pb2.RelayDown | None] = asyncio.Queue(QUEUE_MESSAGES)
        self.answers: dict[int, asyncio.Future] = {}
        self.gone = asyncio.Event()

    def close(self, why: str) -> None:
        self.gone.set()
        for answer in self.answers.values():
            if not answer.done():
                answer.set_exception(ConnectionError(why))


class RelayServicer(peer_pb2_grpc.RelayServicer):
    """Under mutual TLS only: a site is who its certificate names, attaches as itself, and must be a member of
    the run (`members()`: the identities the coordinator has admitted)."""

    def __init__(self, telemetry: Telemetry, authenticated: bool, members: Callable[[], set[str]],
                 attach_grace: float = ATTACH_GRACE_S):
        self.attach_grace = attach_grace
        self.telemetry = telemetry
        self.authenticated = authenticated
        self.members = members
        self.attached: dict[str, Attachment] = {}
        self._attaching = asyncio.Condition()  # notified as a site attaches
        self._numbers = itertools.count(1)

    async def _identity(self, context) -> str:
        identity = peer_identity(context) if self.authenticated else None
        if not identity:
            await rpc.refuse(context, grpc.StatusCode.FAILED_PRECONDITION,
                             "the relay needs mutual TLS (relayed swaps are sealed between the sites' certificates)")
        if identity not in self.members():
            await rpc.refuse(context, grpc.StatusCode.PERMISSION_DENIED, f"{identity!r} is not a member of this run")
        return identity

    async def Attach(self, request_iterator, context):
        identity = await self._identity(context)
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("body") != "attach":
            await rpc.refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "the first message must be `attach`")
        attachment = Attachment(identity)
        older = self.attached.get(identity)
        if older is not None:  # the site reconnected: its old stream is dead to it
            older.close("the site attached again")
        self.attached[identity] = attachment
        log.info("relay: %s attached (%s)", identity, context.peer())
        async with self._attaching:
            self._attaching.notify_all()

        async def read_answers() -> None:
            async for message in request_iterator:
                if message.WhichOneof("body") != "result":
                    continue
                answer = attachment.answers.get(message.result.push)
                if answer is not None and not answer.done():
                    answer.set_result(message.result)

        reader = asyncio.create_task(read_answers())
        reader.add_done_callback(lambda _: attachment.gone.set())
        try:
            while True:
                down = asyncio.create_task(attachment.down.get())
                gone = asyncio.create_task(attachment.gone.wait())
                done, _ = await asyncio.wait((down, gone), return_when=asyncio.FIRST_COMPLETED)
                if down not in done:
                    down.cancel()
                    break
                gone.cancel()
                yield down.result()
        finally:
            reader.cancel()
            attachment.close(f"{identity} left the relay")
            if self.attached.get(identity) is attachment:
                del self.attached[identity]
            log.info("relay: %s detached", identity)

    async def _receiver(self, identity: str) -> Attachment | None:
        """The receiver's attachment; a member not attached yet is waited for attach_grace (a site admitted at
        this boundary, whose copy is pushed while its relay stream is still being set up)."""
        if identity not in self.attached and identity in self.members():
            async with self._attaching:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._attaching.wait_for(lambda: identity in self.attached),
                                           self.attach_grace)
        return self.attached.get(identity)

    async def forward(self, receiver: Attachment, down: peer_pb2.RelayDown) -> None:
        """One message of a push down the receiver's stream (waits while its queue is full)."""
        await receiver.down.put(down)

    async def Push(self, request_iterator, context) -> peer_pb2.PushAck:
        sender = await self._identity(context)
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("body") != "header":
            await rpc.refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "the first message must be the header")
        header = first.header
        if header.sender_identity != sender:
            await rpc.refuse(context, grpc.StatusCode.PERMISSION_DENIED,
                             f"{sender!r} pushes as {header.sender_identity!r}")
        receiver = await self._receiver(header.receiver_identity)
        if receiver is None:
            await rpc.refuse(context, grpc.StatusCode.UNAVAILABLE,
                             f"{header.receiver_identity!r} is not attached to the relay")
        number = next(self._numbers)
        answer = receiver.answers[number] = asyncio.get_running_loop().create_future()
        finished = False
        forwarded = self.telemetry.relayed_bytes.labels(sender, receiver.identity)
        try:
            await self.forward(receiver, peer_pb2.RelayDown(push=number, chunk=first))
            async for chunk in request_iterator:
                if answer.done():  # the receiver answered early (a refusal): the rest is not wanted
                    break
                forwarded.inc(len(chunk.sealed))
                await self.forward(receiver, peer_pb2.RelayDown(push=number, chunk=chunk))
            if not answer.done():
                await self.forward(receiver, peer_pb2.RelayDown(push=number, ended=True))
            result = await answer
            finished = True
        except ConnectionError as exc:
            self.telemetry.relayed_pushes.labels("UNAVAILABLE").inc()
            await rpc.refuse(context, grpc.StatusCode.UNAVAILABLE, f"relay: {exc}")
        finally:
            receiver.answers.pop(number, None)
            if not finished and not receiver.gone.is_set() and not receiver.down.full():
                # the sender gave up: the receiver drops the push (a full queue: its chunk deadline does)
                receiver.down.put_nowait(peer_pb2.RelayDown(push=number, abandoned=True))
        code = next((status for status in grpc.StatusCode if status.value[0] == result.code), None)
        if code is None:  # (a receiver's answer with no status of gRPC's: not passed on as it came)
            code, result.details = grpc.StatusCode.INTERNAL, f"the receiver answered status {result.code}"
        self.telemetry.relayed_pushes.labels(code.name).inc()
        if code != grpc.StatusCode.OK:
            await rpc.refuse(context, code, result.details)
        return peer_pb2.PushAck(received_bytes=result.received_bytes)
