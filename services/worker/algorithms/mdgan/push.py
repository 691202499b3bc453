"""Our discriminator's push to a peer: direct over the Peer service (one channel per receiver, kept for
the session), or sealed for the receiver through the server's relay (services/worker/relay.py)."""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass, field

import grpc
import torch

from mdgan.config import ConfigError
from services.common import codec, rpc, tls as tls_
from services.common.proto import coordinator_pb2 as pb
from services.worker.peer import REFUSED, PushRefused, push_discriminator
from services.worker.relay import push_relayed, relayed_chunks

log = logging.getLogger("mdgan.worker")


@dataclass(frozen=True)
class PushOutcome:
    """Our D's push to our peer: whether it crossed whole, its bytes (tensor payload, wire messages), and what
    went wrong (a push refused by its receiver's check still counts as sent)."""

    sent: bool
    payload_bytes: int = 0
    message_bytes: int = 0
    errors: list[str] = field(default_factory=list)
    relayed_bytes: int = 0  # sealed bytes sent through the server's relay (0: pushed direct)


class PeerPusher:
    """A worker's pushes for one session with the server: the channels to its peers, closed at its end."""

    def __init__(self, node):
        self.node = node
        self.channels: dict[tuple[str, str], grpc.aio.Channel] = {}  # (address, identity) -> channel

    async def close(self) -> None:
        channels, self.channels = self.channels, {}  # a later session opens its own
        for channel in channels.values():
            await channel.close()

    async def push(self, order: pb.SwapOrder, state: dict[str, torch.Tensor], copy: bool = False,
                   deadline: bool = True) -> PushOutcome:
        """Push `state` to order.send_to. A connection that fails (UNAVAILABLE: a link down, a peer's
        channel broken) is opened afresh and the push tried again, within the swap deadline; the receiver
        installs only a state that arrived whole, so a push cut short and tried again is never half-used.
        `deadline` False: a background round's push, which has until its install (and the swap deadline
        after it) to arrive, however long the lag lasts in seconds (the install cancels it then)."""
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
                channel = self.channels.get(key)
                if channel is None:
                    # The receiver is verified as the identity the server named, wherever its address points.
                    channel = self.channels[key] = tls_.channel(order.send_to_address, node.tls, rpc.options(),
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
                        if self.channels.get(key) is channel:
                            del self.channels[key]
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
