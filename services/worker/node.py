"""A worker: holds a data shard and a discriminator, talks to the server over one stream and to
its peers over the Peer service for the discriminator swap."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import torch

from dataclasses import replace

from mdgan import compression
from mdgan.attacks import FeedbackAttack
from mdgan.config import ConfigError, DataConfig
from mdgan.data import Shard, take_shard
from mdgan.sites import NUMERIC_CLASSES, SiteData, map_labels
from mdgan.baselines import LocalGAN, make_flgan_worker_gan, train_local_round
from mdgan.mdgan import DiscriminatorSide, WorkerBatch
from services.common import codec, rpc
from services.common.proto import coordinator_pb2 as pb
from services.common.proto import coordinator_pb2_grpc, peer_pb2, peer_pb2_grpc
from services.common.telemetry import Telemetry

log = logging.getLogger("mdgan.worker")
PEER_SERVICE = peer_pb2.DESCRIPTOR.services_by_name["Peer"].full_name


class ServerGone(Exception):
    """The server stopped answering or closed the stream without a stop message."""


class SwapMailbox:
    """Discriminators pushed by peers, kept until this worker's own swap order asks for them.

    A peer may push before our order arrives, so states are buffered by round; only rounds after
    the last completed one are taken, one state per round, so a peer cannot pile up memory.
    """

    def __init__(self) -> None:
        self.completed_round = 0
        self._boxes: dict[int, asyncio.Future] = {}

    def _box(self, swap_round: int) -> asyncio.Future:
        return self._boxes.setdefault(swap_round, asyncio.get_running_loop().create_future())

    def check(self, swap_round: int) -> tuple[grpc.StatusCode, str] | None:
        if swap_round <= self.completed_round or swap_round > self.completed_round + 2:
            return grpc.StatusCode.FAILED_PRECONDITION, f"round {swap_round} is not expected (last {self.completed_round})"
        if self._box(swap_round).done():
            return grpc.StatusCode.ALREADY_EXISTS, f"a discriminator for round {swap_round} already arrived"
        return None

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
            for r in [r for r in self._boxes if r <= self.completed_round]:
                del self._boxes[r]


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


class PeerServicer(peer_pb2_grpc.PeerServicer):
    def __init__(self, node: "WorkerNode"):
        self.node = node

    async def PushDiscriminator(self, request_iterator, context: grpc.aio.ServicerContext) -> peer_pb2.PushAck:
        side, telemetry = self.node.side, self.node.telemetry
        assembler = codec.StateAssembler(compression.wire_layout(side.state_layout(), side.config.wire_dtype)) \
            if side is not None else None
        # Refusing mid-stream while the peer still writes can surface as INTERNAL on its side, so a
        # refused stream is drained (up to a bound, discarding) and refused once the peer is done.
        refusal: tuple[grpc.StatusCode, str] | None = None
        if side is None:
            refusal = grpc.StatusCode.FAILED_PRECONDITION, "this worker has not joined a run yet"
        drain_limit = 2 * (assembler.expected_bytes() if assembler else codec.CHUNK_BYTES) + codec.CHUNK_BYTES
        discarded = 0
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
                    refusal = self.node.mailbox.check(chunk.header.round)
                    if refusal is not None:
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
        if refusal is not None:
            log.warning("refused a discriminator from %s: %s", context.peer(), refusal[1])
            await context.abort(*refusal)
        try:
            state = compression.unpack_state(state, side.state_layout(), side.config.wire_dtype)
        except compression.PackingError as exc:
            telemetry.rejected.labels(exc.reason).inc()
            log.warning("refused a discriminator from %s: %s", context.peer(), exc)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self.node.mailbox.deliver(assembler.header.round, assembler.header.sender_worker, state)
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
                 telemetry: Telemetry | None = None, device: str = "cpu", attack: str | None = None,
                 slow_factor: float = 1.0):
        if sum(x is not None for x in (shard, dataset, site)) != 1:
            raise ValueError("give a site's data, a shard, or a dataset to take the assigned shard from")
        self.shard = shard
        self.dataset = dataset
        self.site = site
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
        self._write_lock = asyncio.Lock()
        self._peer_channels: dict[str, grpc.aio.Channel] = {}
        self.swap_timeout = 60.0

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
            message = await asyncio.wait_for(call.read(), self.server_timeout)
        except asyncio.TimeoutError:
            raise ServerGone(f"no word from the server for {self.server_timeout:.0f} s") from None
        if message is grpc.aio.EOF:
            code = await call.code()
            raise ServerGone(f"the server closed the stream: {code.name} {await call.details()}")
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
        if self.site is not None:
            site = self.site
            join = pb.Join(own_data=True, shard_size=len(site), num_classes=site.num_classes if site.labelled else 0,
                           class_names=site.class_names or ())
            if self.slot is not None:
                join.shard_index = self.slot
            if site.files is not None:  # images: shaped for the model once its spec is known
                join.image_shape.extend(site.image_shape)
            else:
                join.sample_shape.extend(site.image_shape)
            join.peer_address = self.advertise_address
            return pb.WorkerMessage(join=join)
        if self.shard is not None:
            images, labels = self.shard.images, self.shard.labels
            join = pb.Join(shard_index=self.shard.index, shard_size=len(self.shard))
        else:
            images, labels, _ = self.dataset
            join = pb.Join(dataset_size=images.shape[0])
        join.peer_address = self.advertise_address
        join.sample_shape.extend(images.shape[1:])
        # the dataset's classes, not the shard's: a non-i.i.d. shard may lack the last ones
        join.num_classes = max(NUMERIC_CLASSES, int(labels.max()) + 1)
        return pb.WorkerMessage(join=join)

    async def run(self) -> str:
        """Join, train until told to stop; returns the stop reason."""
        async with grpc.aio.insecure_channel(self.server_address, options=rpc.options()) as channel:
            try:
                await asyncio.wait_for(channel.channel_ready(), self.connect_timeout)
            except asyncio.TimeoutError:
                raise ServerGone(f"could not reach the server at {self.server_address} "
                                 f"within {self.connect_timeout:.0f} s") from None
            call = coordinator_pb2_grpc.CoordinatorStub(channel).Train(timeout=self.run_deadline)
            await self._write(call, self._join_message())
            welcome = await self._read(call)
            if welcome.WhichOneof("body") != "welcome":
                raise ServerGone(f"expected a welcome, got {welcome.WhichOneof('body')}")
            self._on_welcome(welcome.welcome)
            beats = asyncio.create_task(self._heartbeats(call, welcome.welcome.heartbeat_interval_ms / 1000))
            try:
                return await self._serve(call)
            finally:
                beats.cancel()
                await self._close_peers()

    def _on_welcome(self, welcome: pb.Welcome) -> None:
        config = replace(codec.config_from_spec(welcome.spec), device=self.device).validate()
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
        log.info("joined as %s: %s, b=%d, L=%d", self.worker_id, config.model.architecture, config.batch_size,
                 config.disc_steps)

    async def _serve(self, call) -> str:
        swaps: set[asyncio.Task] = set()
        while True:
            message = await self._read(call)
            kind = message.WhichOneof("body")
            if kind == "batches":
                await self._on_batches(call, message.batches)
            elif kind == "swap_order":
                # In the background: a swap_cancel may arrive while we wait for a peer.
                swaps.add(asyncio.create_task(self._swap_and_report(call, message.swap_order)))
                swaps = {t for t in swaps if not t.done()}
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
                for task in swaps:
                    task.cancel()
                await call.done_writing()
                return message.stop.reason

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

    async def _swap(self, order: pb.SwapOrder) -> pb.SwapReport:
        started = time.perf_counter()
        # a snapshot before anything arrives in our place, in its wire form
        state = compression.pack_state(self.side.export_state(), self.side.config.wire_dtype)
        sent, sent_payload, sent_messages, errors = False, 0, 0, []
        try:
            sent_payload, sent_messages = await self._push(order, state)
            sent = True
        except (grpc.aio.AioRpcError, asyncio.TimeoutError) as exc:
            detail = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else "timeout"
            errors.append(f"push to {order.send_to_worker} failed: {detail}")
        received = False
        try:
            sender, incoming = await self.mailbox.collect(order.round, self.swap_timeout)
            if incoming is None:
                errors.append(f"{sender} left before sending its discriminator")
            elif sender == order.receive_from_worker:
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

    async def _push(self, order: pb.SwapOrder, state: dict[str, torch.Tensor]) -> tuple[int, int]:
        address = order.send_to_address
        channel = self._peer_channels.get(address)
        if channel is None:
            channel = self._peer_channels[address] = grpc.aio.insecure_channel(address, options=rpc.options())
        chunks = list(codec.state_chunks(state, order.round, self.worker_id))
        await push_discriminator(peer_pb2_grpc.PeerStub(channel), chunks, self.swap_timeout)
        for chunk in chunks:
            self.telemetry.count("worker_to_worker", "discriminator", "sender", chunk, len(chunk.data))
        return sum(len(c.data) for c in chunks), sum(c.ByteSize() for c in chunks)

    async def _close_peers(self) -> None:
        for channel in self._peer_channels.values():
            await channel.close()

    async def _heartbeats(self, call, interval: float) -> None:
        while True:
            await asyncio.sleep(interval or 5.0)
            try:
                await self._write(call, pb.WorkerMessage(heartbeat=pb.Heartbeat(unix_ms=int(time.time() * 1000))))
            except Exception:  # the stream is closing; the main loop reports why
                return
