"""A worker: holds a data shard and a discriminator, talks to the server over one stream and to
its peers over the Peer service for the discriminator swap."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import shutil
import time

import grpc
import torch

from dataclasses import replace

from mdgan import checkpoint, compression
from mdgan.attacks import FeedbackAttack
from mdgan.checkpoint import CheckpointError, CheckpointStore
from mdgan.config import ConfigError, DataConfig
from mdgan.data import Shard, take_shard
from mdgan.sites import NUMERIC_CLASSES, SiteData, map_labels
from mdgan.baselines import LocalGAN, make_flgan_worker_gan, train_local_round
from mdgan.cluster import RUN_FINISHED
from mdgan.mdgan import DiscriminatorSide, WorkerBatch
from services.common import codec, rpc, tls as tls_
from services.common.proto import coordinator_pb2 as pb
from services.common.proto import coordinator_pb2_grpc, peer_pb2, peer_pb2_grpc
from services.common.telemetry import Telemetry
from services.common.tls import TLSConfig, peer_identity

log = logging.getLogger("mdgan.worker")
PEER_SERVICE = peer_pb2.DESCRIPTOR.services_by_name["Peer"].full_name


class ServerGone(Exception):
    """The worker cannot go on with this server: it sent something invalid, or (StreamBroken) the
    stream broke and reconnecting did not bring it back within --server-timeout."""


class StreamBroken(ServerGone):
    """The stream ended without a stop (the server restarted, the network blipped): reconnect."""


class JoinRefused(Exception):
    """The server refused this worker for good (another run, another identity, a bad join)."""


# Join refusals that retrying cannot change; anything else (UNAVAILABLE while the server restarts,
# ALREADY_EXISTS while it has not yet noticed our previous stream died, ...) is retried.
FINAL_REFUSALS = {grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.PERMISSION_DENIED,
                  grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED,
                  grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNIMPLEMENTED}


CONNECT_TRY_S = 5.0  # how long one connection attempt may take


def backoff_delays(base: float = 0.5, cap: float = 10.0):
    """Exponential backoff with jitter: 0.5, 1, 2, ... capped at 10 s, each scaled by U(0.5, 1) so
    workers that lost the same server do not all knock again at the same instant."""
    attempt = 0
    while True:
        yield min(cap, base * 2 ** attempt) * random.uniform(0.5, 1.0)
        attempt += 1


class SwapMailbox:
    """Discriminators pushed by peers, kept until this worker's own swap order says whom to take one from.

    Each round's order names the one identity this worker accepts a discriminator from
    (`expect`). A push is checked against that order before it is acknowledged: anyone else gets
    PERMISSION_DENIED. A push that arrives before the order is read ahead only when its sender is a
    known member of the run; any other sender is held, unread, until the order decides. Only the
    two rounds after the last completed one are taken, one state per round, so nobody can pile up
    memory.
    """

    def __init__(self) -> None:
        self.completed_round = 0
        self.members: set[str] = set()  # identities of the run's workers, as far as this worker knows
        self._boxes: dict[int, asyncio.Future] = {}
        self._orders: dict[int, asyncio.Future] = {}  # round -> identity of the designated sender

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

    def expect(self, swap_round: int, sender_identity: str) -> None:
        """This worker's order for `swap_round`: take a discriminator from `sender_identity` only."""
        self.members.add(sender_identity)
        order = self._order(swap_round)
        if not order.done():
            order.set_result(sender_identity)

    async def authorize(self, swap_round: int, identity: str, timeout: float) -> tuple[grpc.StatusCode, str] | None:
        """None when `identity` is the designated sender of `swap_round` (waiting for the order if
        it has not come yet); a refusal otherwise."""
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

    def deliver(self, swap_round: int, sender: str, state: dict[str, torch.Tensor] | None) -> None:
        """`state` None: the server says the sender left; nothing will come this round."""
        if swap_round <= self.completed_round:
            return
        box = self._box(swap_round)
        if not box.done():
            box.set_result((sender, state))

    async def collect(self, swap_round: int, timeout: float):
        try:
            return await asyncio.wait_for(self._box(swap_round), timeout)
        finally:
            self.completed_round = max(self.completed_round, swap_round)
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


async def push_discriminator(stub: peer_pb2_grpc.PeerStub, chunks: list[peer_pb2.DiscriminatorChunk],
                             timeout: float) -> peer_pb2.PushAck:
    """Stream a state to a peer. A peer that refuses it mid-stream ends the call with its own
    status (INVALID_ARGUMENT, ...), raised here as AioRpcError, not as a broken write."""
    call = stub.PushDiscriminator(timeout=timeout)
    try:
        for chunk in chunks:
            await call.write(chunk)
        await call.done_writing()
    except (asyncio.InvalidStateError, grpc.aio.AioRpcError):
        # The peer ended the call while we were writing; the failed write only says "INTERNAL",
        # the call's own status (awaited below) says why.
        pass
    return await call


MAX_CONCURRENT_PUSHES = 8  # pushes in progress at once; more are refused (RESOURCE_EXHAUSTED)


class PeerServicer(peer_pb2_grpc.PeerServicer):
    """Receives discriminators. Under mutual TLS the sender is the name in its certificate; with
    --insecure it is the name it claims in the header. Either way it must be the sender the server
    designated for the round (see SwapMailbox)."""

    def __init__(self, node: "WorkerNode"):
        self.node = node
        self.active = 0
        self.warnings = rpc.RateLimitedWarnings(log)

    def sender_identity(self, context: grpc.aio.ServicerContext, header: peer_pb2.DiscriminatorHeader) -> str:
        if self.node.tls is not None:
            return peer_identity(context) or ""
        return header.sender_identity or header.sender_worker

    async def PushDiscriminator(self, request_iterator, context: grpc.aio.ServicerContext) -> peer_pb2.PushAck:
        if self.active >= MAX_CONCURRENT_PUSHES:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many discriminator pushes at once")
        self.active += 1
        try:
            return await self._receive(request_iterator, context)
        finally:
            self.active -= 1

    async def _receive(self, request_iterator, context: grpc.aio.ServicerContext) -> peer_pb2.PushAck:
        node = self.node
        side, telemetry, mailbox = node.side, node.telemetry, node.mailbox
        assembler = codec.StateAssembler(compression.wire_layout(side.state_layout(), side.config.wire_dtype)) \
            if side is not None else None
        # Refusing mid-stream while the peer still writes can surface as INTERNAL on its side, so a
        # refused stream is drained (up to a bound, discarding) and refused once the peer is done.
        refusal: tuple[grpc.StatusCode, str] | None = None
        if side is None:
            refusal = grpc.StatusCode.FAILED_PRECONDITION, "this worker has not joined a run yet"
        drain_limit = 2 * (assembler.expected_bytes() if assembler else codec.CHUNK_BYTES) + codec.CHUNK_BYTES
        discarded = 0
        sender, authorized = "", False
        async for chunk in request_iterator:
            telemetry.count("worker_to_worker", "discriminator", "receiver", chunk, len(chunk.data))
            if refusal is not None:
                discarded += len(chunk.data)
                if discarded > drain_limit:
                    break
                continue
            try:
                if assembler.header is None:
                    if chunk.WhichOneof("body") != "header":
                        raise codec.InvalidTensor("protocol", "the first chunk must be the header")
                    mailbox = self.node.copies if chunk.header.copy else self.node.mailbox
                    refusal = mailbox.check(chunk.header.round)
                    if refusal is not None:
                        continue
                    assembler.accept(chunk)
                    sender = self.sender_identity(context, chunk.header)
                    if sender not in mailbox.members:  # not known to be in the run: read nothing before the order
                        refusal = await mailbox.authorize(chunk.header.round, sender, node.swap_timeout)
                        authorized = refusal is None
                    continue
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
            refusal = await mailbox.authorize(assembler.header.round, sender, node.swap_timeout)
        if refusal is not None:
            if refusal[0] == grpc.StatusCode.PERMISSION_DENIED:
                telemetry.rejected.labels("sender").inc()
            self.warnings.warn(refusal[0].name, "refused a discriminator from %s (%s): %s", sender or "?",
                               context.peer(), refusal[1])
            await context.abort(*refusal)
        try:
            state = compression.unpack_state(state, side.state_layout(), side.config.wire_dtype)
        except compression.PackingError as exc:
            telemetry.rejected.labels(exc.reason).inc()
            log.warning("refused a discriminator from %s: %s", context.peer(), exc)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        mailbox.deliver(assembler.header.round, sender, state)
        return peer_pb2.PushAck(received_bytes=assembler.header.total_bytes)


class WorkerNode:
    """Holds one of: its site's own data (shaped for the model once the server's spec arrives; its
    slot chosen by the operator or by the server), its shard of a shared dataset (emulation; index
    chosen by the operator), or the whole shared dataset it will cut its shard from once the server
    assigns an index."""

    def __init__(self, server_address: str, advertise_address: str, *, shard: Shard | None = None,
                 dataset: tuple[torch.Tensor, torch.Tensor, DataConfig] | None = None,
                 site: SiteData | None = None, slot: int | None = None,
                 connect_timeout: float = 300.0, server_timeout: float = 120.0, run_deadline: float = 7 * 24 * 3600.0,
                 telemetry: Telemetry | None = None, device: str = "cpu", tls: TLSConfig | None = None,
                 identity: str = "", server_name: str | None = None, state_dir: str | None = None,
                 keep_checkpoints: int = 3, run_id: str | None = None, reconnect: bool = True,
                 attack: str | None = None, slow_factor: float = 1.0):
        if sum(x is not None for x in (shard, dataset, site)) != 1:
            raise ValueError("give a site's data, a shard, or a dataset to take the assigned shard from")
        self.shard = shard
        self.dataset = dataset
        self.site = site
        self._site_join: pb.Join | None = None  # a site's data facts, sent again on every rejoin
        self.slot = slot  # sites: the slot (rank) asked for; None: the server assigns one
        self.telemetry = telemetry or Telemetry("worker")
        self.device = device  # this worker's own choice; the run's spec does not carry one
        # Emulation for experiments (mdgan-worker --attack, --slow-factor): a Byzantine worker, a straggler.
        self.attack_kind = attack
        self.attack = None  # built once the run's seed is known (welcome)
        self.slow_factor = slow_factor
        self.server_address = server_address
        self.advertise_address = advertise_address
        self.connect_timeout = connect_timeout
        self.server_timeout = server_timeout
        self.run_deadline = run_deadline
        self.side: DiscriminatorSide | None = None  # MD-GAN
        self.gan: LocalGAN | None = None  # FL-GAN: this worker trains a whole GAN
        self._incoming: dict[tuple[int, str], codec.StateAssembler] = {}
        self.worker_id = ""
        self.mailbox = SwapMailbox()
        self.copies = CopyMailbox()
        self._write_lock = asyncio.Lock()
        self._peer_channels: dict[str, grpc.aio.Channel] = {}
        self.swap_timeout = 60.0
        self.tls = tls  # None: --insecure
        self.identity = identity or (tls.identity if tls else "")
        self.server_name = server_name
        # Durable runs: the run this worker is in, where it keeps its state, how far its D trained.
        self.state_dir = state_dir
        self.keep_checkpoints = keep_checkpoints
        self.reconnect = reconnect
        self.trained_iteration = 0
        self.run_id = run_id or self._saved_run().get("run_id")
        self.pinned_run = run_id  # --run-id: join that run only

    # -- durable state ---------------------------------------------------------------------------
    def _saved_run(self) -> dict:
        """What the state dir says about the run this worker was last in ({} if nothing)."""
        if not self.state_dir:
            return {}
        try:
            saved = checkpoint.read_json(os.path.join(self.state_dir, "current.json"))
            return {} if saved.get("finished") else saved
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{self.state_dir}/current.json is unreadable: {exc}") from exc

    def _forget_run(self) -> None:
        """The run is over: its states are of no more use, and the next run may take this worker."""
        if not (self.state_dir and self.run_id):
            return
        checkpoint.atomic_write_json(os.path.join(self.state_dir, "current.json"),
                                     {"run_id": self.run_id, "shard_index": self.shard.index, "finished": True})
        shutil.rmtree(os.path.join(self.state_dir, self.run_id), ignore_errors=True)

    def _store(self) -> CheckpointStore | None:
        if not (self.state_dir and self.run_id):
            return None
        return CheckpointStore(os.path.join(self.state_dir, self.run_id), self.keep_checkpoints)

    def _held(self) -> list[int]:
        store = self._store()
        return store.holding("worker") if store else []

    def _save_state(self, iteration: int) -> None:
        store = self._store()
        store.save(iteration, "worker", self.side.state_dict())
        store.prune(marker=None)

    async def _write(self, call, message: pb.WorkerMessage) -> None:
        async with self._write_lock:
            await call.write(message)
        body = message.WhichOneof("body")
        if body == "feedback":
            kind, payload = "feedback", len(message.feedback.gradient.data) + len(message.feedback.gradient.scales)
        elif body == "model_part":
            kind, payload = message.model_part.model, len(message.model_part.data)
        else:
            kind, payload = "control", 0
        self.telemetry.count("worker_to_server", kind, "sender", message, payload)

    async def _read(self, call):
        try:
            async with asyncio.timeout(self.server_timeout):  # (wait_for would make a task per read)
                message = await call.read()
        except asyncio.TimeoutError:
            raise StreamBroken(f"no word from the server for {self.server_timeout:.0f} s") from None
        if message is grpc.aio.EOF:
            code = await call.code()
            raise StreamBroken(f"the server closed the stream: {code.name} {await call.details()}")
        if message.WhichOneof("body") == "batches":
            b = message.batches
            self.telemetry.count("server_to_worker", "batches", "receiver", message,
                                 sum(len(t.data) + len(t.scales) for t in (b.generated, b.discriminated)))
        elif message.WhichOneof("body") == "model_part":
            part = message.model_part
            self.telemetry.count("server_to_worker", part.model if part.model in ("generator", "discriminator")
                                 else "control", "receiver", message, len(part.data))
        else:
            self.telemetry.count("server_to_worker", "control", "receiver", message)
        return message

    def _join_message(self) -> pb.WorkerMessage:
        if self.site is not None or self._site_join is not None:
            if self._site_join is None:  # what the site tells the server about its data, kept for rejoins
                site = self.site
                self._site_join = pb.Join(own_data=True, shard_size=len(site),
                                          num_classes=site.num_classes if site.labelled else 0,
                                          class_names=site.class_names or ())
                if site.files is not None:  # images: shaped for the model once its spec is known
                    self._site_join.image_shape.extend(site.image_shape)
                else:
                    self._site_join.sample_shape.extend(site.image_shape)
            join = pb.Join()
            join.CopyFrom(self._site_join)
            if self.shard is not None:  # back after a break: the slot this site held
                join.shard_index = self.shard.index
            elif self.slot is not None:
                join.shard_index = self.slot
        elif self.shard is not None:
            images, labels = self.shard.images, self.shard.labels
            join = pb.Join(shard_index=self.shard.index, shard_size=len(self.shard))
        else:
            images, labels, _ = self.dataset
            join = pb.Join(dataset_size=images.shape[0])
        if not join.own_data:
            join.sample_shape.extend(images.shape[1:])
            # the dataset's classes, not the shard's: a non-i.i.d. shard may lack the last ones
            join.num_classes = max(NUMERIC_CLASSES, int(labels.max()) + 1)
        join.peer_address = self.advertise_address
        join.name = self.identity
        if self.run_id:
            join.run_id = self.run_id
            join.checkpoints.extend(self._held())
            join.trained_iteration = self.trained_iteration if self.side is not None else 0
        return pb.WorkerMessage(join=join)

    async def run(self) -> str:
        """Join, train until told to stop; returns the stop reason. A broken stream is not the end:
        the worker reconnects (backoff with jitter) and rejoins the same run, until it has heard
        nothing from a server of its run for --server-timeout seconds."""
        deadline = time.monotonic() + self.connect_timeout  # the first contact
        delays = backoff_delays()
        while True:
            try:
                return await self._session(deadline)
            except JoinRefused:
                raise
            except (StreamBroken, grpc.aio.AioRpcError) as exc:
                if isinstance(exc, grpc.aio.AioRpcError) and exc.code() in FINAL_REFUSALS:
                    raise JoinRefused(f"{exc.code().name}: {exc.details()}") from None
                why = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                if not self.reconnect:
                    raise ServerGone(why) from None
                if self._contact is not None:  # we were in: from now on the server timeout bounds the wait
                    deadline = self._contact + self.server_timeout
                    self._contact = None
                    delays = backoff_delays()
                    self.telemetry.departures.labels("reconnect").inc()
                delay = next(delays)
                if time.monotonic() + delay >= deadline:
                    raise ServerGone(f"no server of our run came back in time (last: {why})") from None
                log.warning("lost the server (%s); reconnecting in %.1f s", why, delay)
                await asyncio.sleep(delay)

    _contact: float | None = None  # monotonic time of the last message from the server, while joined

    async def _session(self, deadline: float) -> str:
        """One connection: join, train until stopped or the stream breaks."""
        async with tls_.channel(self.server_address, self.tls, rpc.options(), self.server_name) as channel:
            remaining = deadline - time.monotonic()
            try:  # a short try, then our own backoff: gRPC's would wait up to two minutes between tries
                await asyncio.wait_for(channel.channel_ready(), max(0.1, min(remaining, CONNECT_TRY_S)))
            except asyncio.TimeoutError:
                if remaining <= CONNECT_TRY_S:
                    raise ServerGone(f"could not reach the server at {self.server_address} in time") from None
                raise StreamBroken(f"the server at {self.server_address} is not reachable") from None
            call = coordinator_pb2_grpc.CoordinatorStub(channel).Train(timeout=self.run_deadline)
            await self._write(call, self._join_message())
            try:
                welcome = await self._read(call)
            except StreamBroken:
                code = await call.code()
                if code in FINAL_REFUSALS:
                    raise JoinRefused(f"the server refused us: {code.name}: {await call.details()}") from None
                raise
            if welcome.WhichOneof("body") != "welcome":
                raise ServerGone(f"expected a welcome, got {welcome.WhichOneof('body')}")
            await self._on_welcome(welcome.welcome)
            self._contact = time.monotonic()
            beats = asyncio.create_task(self._heartbeats(call, welcome.welcome.heartbeat_interval_ms / 1000))
            swaps: set[asyncio.Task] = set()
            try:
                return await self._serve(call, swaps)
            finally:
                beats.cancel()
                for task in swaps:
                    task.cancel()
                await self._close_peers()

    async def _on_welcome(self, welcome: pb.Welcome) -> None:
        if self.pinned_run and welcome.run_id != self.pinned_run:
            raise JoinRefused(f"the server runs run {welcome.run_id!r}, and this worker joins run "
                              f"{self.pinned_run!r} only (--run-id)")
        if self.run_id and welcome.run_id and welcome.run_id != self.run_id:
            raise JoinRefused(f"the server runs run {welcome.run_id!r}, this worker was in run {self.run_id!r}")
        config = replace(codec.config_from_spec(welcome.spec), device=self.device).validate()
        if welcome.run_id:
            self.run_id = welcome.run_id
        if self.side is not None and self.side.config == config and welcome.spec.algorithm in ("", "mdgan"):
            # Back in the same run: keep our discriminator unless the server says to restore a saved one.
            await self._restore(welcome)
            return
        if self.site is not None:
            site, classes = self.site, tuple(welcome.spec.class_names) or None
            try:
                images, labels = site.conform(config.model.sample_shape), map_labels(site, classes)
            except ConfigError as exc:
                raise ServerGone(f"this site's data does not fit the run: {exc}") from exc
            self.shard = Shard(images, labels, welcome.shard_index, config.workers)
            self.site = None  # keep only the shaped samples
            log.info("slot %d of %d: this site's %d samples, shaped %s", welcome.shard_index, config.workers,
                     len(self.shard), tuple(config.model.sample_shape))
        elif self.shard is None:
            images, labels, data = self.dataset
            data = replace(data, num_shards=config.workers)
            self.shard = take_shard(images, labels, welcome.shard_index, data, config.model.sample_shape)
            self.dataset = None  # keep only our shard
            log.info("the server assigned shard %d of %d (%d samples)", self.shard.index, config.workers,
                     len(self.shard))
        elif self.shard.num_shards != config.workers:
            raise ServerGone(f"this worker cut the data into {self.shard.num_shards} shards but the run has "
                             f"{config.workers} workers: set --num-shards {config.workers}")
        self.worker_id = welcome.worker_id
        self.swap_timeout = welcome.swap_timeout_ms / 1000 or self.swap_timeout
        if welcome.spec.algorithm == "flgan":
            self.gan = make_flgan_worker_gan(config, self.shard)
        elif welcome.spec.algorithm in ("", "mdgan"):
            self.side = DiscriminatorSide(config, self.shard)
            if self.attack_kind:
                self.attack = FeedbackAttack(self.attack_kind, config.seed, self.shard.index)
                log.warning("emulating a Byzantine worker: %s feedback", self.attack_kind)
        else:
            raise ServerGone(f"the server runs {welcome.spec.algorithm!r}, which this worker does not know")
        log.info("joined run %s as %s: %s, b=%d, L=%d", self.run_id or "(no id)", self.worker_id,
                 config.model.architecture, config.batch_size, config.disc_steps)
        await self._restore(welcome)

    async def _restore(self, welcome: pb.Welcome) -> None:
        """Set up what the welcome says: the swap rounds done, our own saved state or a copy to wait for."""
        self.worker_id = welcome.worker_id
        self.swap_timeout = welcome.swap_timeout_ms / 1000 or self.swap_timeout
        self.mailbox = SwapMailbox()
        self.mailbox.completed_round = welcome.swap_round
        self.copies = CopyMailbox()
        self.copies.awaiting = welcome.copy
        self.identity = welcome.identity or self.identity
        self.mailbox.members.update(welcome.members)
        if self.state_dir and self.run_id and self.side is not None:
            checkpoint.atomic_write_json(os.path.join(self.state_dir, "current.json"),
                                         {"run_id": self.run_id, "shard_index": self.shard.index})
        if welcome.restore_iteration and self.side is not None:
            store = self._store()
            if store is None:
                raise ServerGone(f"asked to restore iteration {welcome.restore_iteration} but keeping no state")
            state = await asyncio.to_thread(store.load, welcome.restore_iteration, "worker")
            self.side.load_state_dict(state)
            self.trained_iteration = welcome.restore_iteration
            log.info("restored our state of iteration %d", welcome.restore_iteration)
        elif welcome.copy:
            log.info("waiting for a copy of a live peer's discriminator")

    async def _serve(self, call, swaps: set[asyncio.Task]) -> str:
        while True:
            message = await self._read(call)
            self._contact = time.monotonic()
            kind = message.WhichOneof("body")
            if kind == "batches":
                await self._on_batches(call, message.batches)
            elif kind == "checkpoint":
                await self._on_checkpoint(call, message.checkpoint)
            elif kind == "swap_order":
                order = message.swap_order
                # Known before anything else happens: pushes for this round (or this copy) are checked against it.
                box = self.copies if order.kind == "copy" else self.mailbox
                if order.receive_from_identity or order.receive_from_worker:
                    box.expect(order.round, order.receive_from_identity or order.receive_from_worker)
                if order.send_to_identity:
                    self.mailbox.members.add(order.send_to_identity)
                # In the background: a swap_cancel may arrive while we wait for a peer.
                swaps.add(asyncio.create_task(self._swap_and_report(call, message.swap_order)))
                swaps.difference_update([t for t in swaps if t.done()])
            elif kind == "swap_cancel":
                cancel = message.swap_cancel
                log.warning("swap %d: %s left (%s)", cancel.round, cancel.sender_worker, cancel.reason)
                self.mailbox.deliver(cancel.round, cancel.sender_worker, None)
            elif kind == "model_part":
                self._on_model_part(message.model_part)
            elif kind == "local_round":
                await self._on_local_round(call, message.local_round)
            elif kind == "rejection":
                r = message.rejection
                log.error("the server rejected our input at iteration %d: %s (%s)", r.iteration, r.message, r.reason)
            elif kind == "stop":
                log.info("stopped by the server: %s", message.stop.reason)
                if message.stop.reason == RUN_FINISHED:
                    self._forget_run()
                await call.done_writing()
                return message.stop.reason

    async def _on_checkpoint(self, call, order: pb.CheckpointOrder) -> None:
        error = ""
        if self.side is None:
            error = "this worker trains no discriminator"
        elif not self.state_dir:
            error = "this worker keeps no state (no --state-dir)"
        elif order.run_id != self.run_id:
            error = f"checkpoint for run {order.run_id!r}, this worker is in run {self.run_id!r}"
        else:
            try:  # in a thread: the event loop goes on serving peers and heartbeats
                await asyncio.to_thread(self._save_state, order.iteration)
            except OSError as exc:
                error = f"could not write state: {exc}"
        if error:
            log.error("checkpoint %d: %s", order.iteration, error)
        await self._write(call, pb.WorkerMessage(checkpoint_done=pb.CheckpointDone(
            iteration=order.iteration, ok=not error, error=error)))

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
        started = time.perf_counter()
        # On the event loop's own thread: a step takes milliseconds, and a hop to a worker thread
        # and back (two thread wake-ups per iteration) cost a measurable share of them. Peers and
        # heartbeats wait at most one step; the server sends nothing else until this feedback.
        result = self.side.step(batch)
        self.trained_iteration = batches.iteration
        if self.slow_factor > 1:  # an emulated straggler
            await asyncio.sleep((self.slow_factor - 1) * (time.perf_counter() - started))
        feedback = result.feedback if self.attack is None else self.attack(result.feedback)
        await self._write(call, pb.WorkerMessage(feedback=pb.Feedback(
            iteration=batches.iteration, gradient=codec.encode_packed(compression.pack(feedback, wire)),
            stats=pb.StepStats(disc_loss=result.disc_loss, gen_loss=result.gen_loss,
                               real_accuracy=result.real_accuracy, fake_accuracy=result.fake_accuracy))))
        t = self.telemetry
        t.iterations.inc()
        t.iteration_seconds.observe(time.perf_counter() - started)
        t.phase_seconds.labels("disc_steps").observe(result.disc_seconds)
        t.phase_seconds.labels("feedback").observe(result.feedback_seconds)
        t.generator_loss.set(result.gen_loss)
        t.discriminator_loss.set(result.disc_loss)
        t.discriminator_accuracy.labels("real").set(result.real_accuracy)
        t.discriminator_accuracy.labels("generated").set(result.fake_accuracy)
        t.last_iteration.set_to_current_time()

    # -- FL-GAN ------------------------------------------------------------------------------------
    def _on_model_part(self, part: pb.ModelPart) -> None:
        if self.gan is None:
            raise ServerGone("the server sent a model to an MD-GAN worker")
        key = (part.round, part.model)
        if key not in self._incoming:
            modules = {"generator": self.gan.g.generator, "discriminator": self.gan.d.discriminator}
            if part.model not in modules:
                raise ServerGone(f"the server sent an unknown model {part.model!r}")
            self._incoming[key] = codec.StateAssembler(codec.layout_of(modules[part.model].state_dict()))
        try:
            self._incoming[key].accept(part)
        except codec.InvalidTensor as exc:
            raise ServerGone(f"the server sent an invalid {part.model}: {exc}") from exc

    async def _on_local_round(self, call, order: pb.LocalRound) -> None:
        try:
            states = {m: self._incoming.pop((order.round, m)).finish() for m in ("generator", "discriminator")}
        except (KeyError, codec.InvalidTensor) as exc:
            raise ServerGone(f"round {order.round} came without valid models: {exc!r}") from exc
        self._incoming.clear()
        started = time.perf_counter()
        result = await asyncio.to_thread(train_local_round, self.gan, states["generator"], states["discriminator"],
                                         order.iterations)
        for model, state in (("generator", result.generator), ("discriminator", result.discriminator)):
            for part in codec.model_parts(state, order.round, model):
                await self._write(call, pb.WorkerMessage(model_part=part))
        await self._write(call, pb.WorkerMessage(local_round_done=pb.LocalRoundDone(
            round=order.round, stats=[pb.StepStats(**s) for s in result.stats])))
        t = self.telemetry
        t.iterations.inc(order.iterations)
        t.iteration_seconds.observe((time.perf_counter() - started) / max(1, order.iterations))
        if result.stats:
            t.generator_loss.set(result.stats[-1]["gen_loss"])
            t.discriminator_loss.set(result.stats[-1]["disc_loss"])
        t.last_iteration.set_to_current_time()

    async def _swap_and_report(self, call, order: pb.SwapOrder) -> None:
        report = await self._swap(order)
        await self._write(call, pb.WorkerMessage(swap_report=report))

    async def _copy(self, order: pb.SwapOrder) -> pb.SwapReport:
        """A one-way copy for a late joiner: we give ours (send_to set) or take one (receive_from set)."""
        if order.send_to_worker:
            try:
                state = compression.pack_state(self.side.export_state(), self.side.config.wire_dtype)
                payload, messages = await self._push(order, state, copy=True)
                return pb.SwapReport(round=order.round, sent=True, sent_payload_bytes=payload,
                                     sent_message_bytes=messages)
            except (grpc.aio.AioRpcError, asyncio.TimeoutError) as exc:
                detail = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else "timeout"
                return pb.SwapReport(round=order.round, error=f"copy to {order.send_to_worker} failed: {detail}")
        try:
            sender, incoming = await self.copies.collect(order.round, self.swap_timeout)
        except asyncio.TimeoutError:
            return pb.SwapReport(round=order.round, error=f"no copy from {order.receive_from_worker}")
        if incoming is None or sender != (order.receive_from_identity or order.receive_from_worker):
            return pb.SwapReport(round=order.round, error=f"expected a copy from {order.receive_from_worker}, got {sender}")
        self.side.adopt(incoming)
        self.copies.awaiting = False
        log.info("took a copy of %s's discriminator", sender)
        return pb.SwapReport(round=order.round, received=True)

    async def _swap(self, order: pb.SwapOrder) -> pb.SwapReport:
        if order.kind == "copy":
            return await self._copy(order)
        started = time.perf_counter()
        # a snapshot before anything arrives in our place, in its wire form
        state = compression.pack_state(self.side.export_state(), self.side.config.wire_dtype)
        sent, sent_payload, sent_messages, errors = False, 0, 0, []
        try:
            sent_payload, sent_messages = await self._push(order, state)
            sent = True
        except (grpc.aio.AioRpcError, asyncio.TimeoutError, grpc.aio.UsageError) as exc:
            detail = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else repr(exc)
            errors.append(f"push to {order.send_to_worker} failed: {detail}")
        received = False
        try:
            sender, incoming = await self.mailbox.collect(order.round, self.swap_timeout)
            expected = order.receive_from_identity or order.receive_from_worker
            if incoming is None:
                errors.append(f"{sender} left before sending its discriminator")
            elif sender == expected:
                self.side.import_state(incoming)
                received = True
            else:
                errors.append(f"expected a discriminator from {order.receive_from_worker}, got {sender}")
        except asyncio.TimeoutError:
            errors.append(f"no discriminator from {order.receive_from_worker} within {self.swap_timeout:.0f} s")
        for e in errors:
            log.warning("swap %d: %s", order.round, e)
        self.telemetry.swaps.labels("complete" if sent and received else "incomplete").inc()
        self.telemetry.phase_seconds.labels("swap").observe(time.perf_counter() - started)
        return pb.SwapReport(round=order.round, sent=sent, received=received, sent_payload_bytes=sent_payload,
                             sent_message_bytes=sent_messages, error="; ".join(errors))

    async def _push(self, order: pb.SwapOrder, state: dict[str, torch.Tensor], copy: bool = False) -> tuple[int, int]:
        address = order.send_to_address
        key = (address, order.send_to_identity)  # another identity at the same address needs its own channel
        channel = self._peer_channels.get(key)
        if channel is None:
            # The receiver is verified as the identity the server named, wherever its address points.
            channel = self._peer_channels[key] = tls_.channel(address, self.tls, rpc.options(),
                                                              order.send_to_identity or None)
        chunks = list(codec.state_chunks(state, order.round, self.worker_id, self.identity))
        chunks[0].header.copy = copy
        await push_discriminator(peer_pb2_grpc.PeerStub(channel), chunks, self.swap_timeout)
        for chunk in chunks:
            self.telemetry.count("worker_to_worker", "discriminator", "sender", chunk, len(chunk.data))
        return sum(len(c.data) for c in chunks), sum(c.ByteSize() for c in chunks)

    async def _close_peers(self) -> None:
        channels, self._peer_channels = self._peer_channels, {}  # a later session opens its own
        for channel in channels.values():
            await channel.close()

    async def _heartbeats(self, call, interval: float) -> None:
        while True:
            await asyncio.sleep(interval or 5.0)
            try:
                await self._write(call, pb.WorkerMessage(heartbeat=pb.Heartbeat(unix_ms=int(time.time() * 1000))))
            except Exception:  # the stream is closing; the main loop reports why
                return
