"""The Coordinator service: admits workers and exposes each one to the Trainer as a WorkerHandle.

A GrpcWorker is the server's proxy of one worker's stream (Flower's ClientProxy idea): the
training loop calls step()/swap()/stop() on it exactly as on an in-process worker.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import torch

from mdgan import compression
from mdgan.baselines import FederatedWorker, LocalRoundResult
from mdgan.cluster import RUN_FINISHED, InputRejected, SwapOrder, SwapReport, WorkerHandle, WorkerLost
from mdgan.config import TrainingConfig
from mdgan.data import shard_sizes
from mdgan.sites import RunClasses, check_class_names, model_image_shape, resizable
from mdgan.mdgan import StepResult, WorkerBatch
from services.common import codec
from services.common.telemetry import Telemetry
from services.common.proto import coordinator_pb2 as pb
from services.common.proto import tensor_pb2
from services.common.proto import coordinator_pb2_grpc

log = logging.getLogger("mdgan.server")

INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]  # 3, the google.rpc.Code value
def _kind(message) -> str:
    """The traffic kind of a stream message (a telemetry label)."""
    body = message.WhichOneof("body")
    if body == "model_part":
        return message.model_part.model  # FL-GAN: generator or discriminator
    return {"batches": "batches", "feedback": "feedback"}.get(body, "control")


def tensor_payload(tensor) -> int:
    """What a tensor costs on the wire: its values, and its int8 scales when compressed."""
    return len(tensor.data) + len(tensor.scales)


def _payload(message) -> int:
    """Bytes of the tensors Table III counts: X_g and X_d down, F_n up (labels are not in it); FL-GAN: models."""
    body = message.WhichOneof("body")
    if body == "batches":
        return tensor_payload(message.batches.generated) + tensor_payload(message.batches.discriminated)
    if body == "feedback":
        return tensor_payload(message.feedback.gradient)
    if body == "model_part":
        return len(message.model_part.data)
    return 0


class BatchEncoder:
    """Encodes each of an iteration's kappa batches once, however many of the N workers get it."""

    def __init__(self) -> None:
        self._iteration = -1
        self._encoded: dict[int, tuple[torch.Tensor, tensor_pb2.Tensor]] = {}

    def encode(self, iteration: int, tensor: torch.Tensor, wire_dtype: str | None = None) -> tensor_pb2.Tensor:
        """`wire_dtype`: a float tensor in the run's wire form (mdgan/compression.py); None: as it is."""
        if iteration != self._iteration:
            self._iteration, self._encoded = iteration, {}
        hit = self._encoded.get(id(tensor))
        if hit is None or hit[0] is not tensor:
            encoded = codec.encode_tensor(tensor) if wire_dtype is None else \
                codec.encode_packed(compression.pack(tensor, wire_dtype))
            hit = self._encoded[id(tensor)] = (tensor, encoded)  # holding it pins its id
        return hit[1]


class GrpcWorker(WorkerHandle, FederatedWorker):
    def __init__(self, shard_index: int, shard_size: int, join: pb.Join, context: grpc.aio.ServicerContext,
                 config: TrainingConfig, telemetry: Telemetry, liveness_timeout: float,
                 model_layouts: dict[str, dict] | None = None, encoder: BatchEncoder | None = None):
        self.worker_id = f"worker-{shard_index}"
        self.shard_index = shard_index
        self.shard_size = shard_size
        self.peer_address = join.peer_address
        self.context = context
        self.config = config
        self.telemetry = telemetry
        self.liveness_timeout = liveness_timeout
        self.swap_message_bytes = 0  # serialized bytes this worker reports pushing to peers
        self.closed = asyncio.Event()
        self.lost_reason: str | None = None
        self._write_lock = asyncio.Lock()
        self._steps: dict[int, asyncio.Future] = {}
        self._swaps: dict[int, asyncio.Future] = {}
        self.address_book: dict[str, str] = {}  # worker id -> peer address, filled by the Coordinator
        # FL-GAN: the models coming back in the current round, checked against these layouts
        self.model_layouts = model_layouts or {}
        self._rounds: dict[int, asyncio.Future] = {}
        self._returning: dict[tuple[int, str], codec.StateAssembler] = {}
        self._discarding = -1  # a round already refused: the rest of its parts are dropped quietly
        self.encoder = encoder or BatchEncoder()  # shared by the run's workers
        self.last_write = time.monotonic()

    # -- sending -----------------------------------------------------------------------------
    async def send(self, message: pb.ServerMessage) -> None:
        if self.closed.is_set():
            raise WorkerLost(f"{self.worker_id}: stream closed ({self.lost_reason or 'stopped'})")
        try:
            async with self._write_lock:
                await self.context.write(message)
                self.last_write = time.monotonic()
        except Exception as exc:  # the stream broke under us: the worker is gone
            self.lose(f"write failed: {exc!r}")
            raise WorkerLost(f"{self.worker_id}: {exc!r}") from exc
        self.telemetry.count("server_to_worker", _kind(message), "sender", message, _payload(message))

    async def step(self, iteration: int, batch: WorkerBatch) -> StepResult:
        encode, wire = self.encoder.encode, self.config.wire_dtype
        message = pb.ServerMessage(batches=pb.Batches(
            iteration=iteration,
            generated=encode(iteration, batch.generated, wire),
            discriminated=encode(iteration, batch.discriminated, wire),
            generated_labels=None if batch.generated_labels is None else encode(iteration, batch.generated_labels),
            discriminated_labels=None if batch.discriminated_labels is None
            else encode(iteration, batch.discriminated_labels)))
        future = asyncio.get_running_loop().create_future()
        self._steps[iteration] = future
        try:
            await self.send(message)
            return await future
        finally:
            self._steps.pop(iteration, None)

    async def swap(self, order: SwapOrder) -> SwapReport:
        future = asyncio.get_running_loop().create_future()
        self._swaps[order.swap_round] = future
        try:
            await self.send(pb.ServerMessage(swap_order=pb.SwapOrder(
                round=order.swap_round, send_to_worker=order.send_to,
                send_to_address=self.address_book.get(order.send_to, ""), receive_from_worker=order.receive_from)))
            return await future
        finally:
            self._swaps.pop(order.swap_round, None)

    async def local_round(self, round_: int, first_iteration: int, iterations: int,
                          generator: dict[str, torch.Tensor], discriminator: dict[str, torch.Tensor]) -> LocalRoundResult:
        future = asyncio.get_running_loop().create_future()
        self._rounds[round_] = future
        self._returning = {(round_, model): codec.StateAssembler(layout) for model, layout in self.model_layouts.items()}
        try:
            for model, state in (("generator", generator), ("discriminator", discriminator)):
                for part in codec.model_parts(state, round_, model):
                    await self.send(pb.ServerMessage(model_part=part))
            await self.send(pb.ServerMessage(local_round=pb.LocalRound(
                round=round_, first_iteration=first_iteration, iterations=iterations)))
            return await future
        finally:
            self._rounds.pop(round_, None)
            self._returning = {}

    async def cancel_swap(self, swap_round: int, sender: str, reason: str) -> None:
        await self.send(pb.ServerMessage(swap_cancel=pb.SwapCancel(round=swap_round, sender_worker=sender,
                                                                   reason=reason)))

    async def stop(self, reason: str) -> None:
        if self.closed.is_set():
            return
        if reason != RUN_FINISHED:
            self.telemetry.departures.labels("dropped").inc()
        try:
            await self.send(pb.ServerMessage(stop=pb.Stop(reason=reason)))
        finally:
            self.closed.set()

    def lose(self, reason: str) -> None:
        """The stream is gone: every pending answer fails with WorkerLost."""
        if self.lost_reason is None and not self.closed.is_set():
            self.lost_reason = reason
            self.telemetry.departures.labels("disconnected").inc()
            log.warning("%s lost: %s", self.worker_id, reason)
        for future in [*self._steps.values(), *self._swaps.values(), *self._rounds.values()]:
            if not future.done():
                future.set_exception(WorkerLost(f"{self.worker_id}: {reason}"))
        self.closed.set()

    # -- receiving ---------------------------------------------------------------------------
    async def read_loop(self) -> None:
        while not self.closed.is_set():
            try:
                message = await asyncio.wait_for(self.context.read(), self.liveness_timeout)
            except asyncio.TimeoutError:
                self.lose(f"silent for {self.liveness_timeout:.0f} s")
                return
            except Exception as exc:
                self.lose(f"read failed: {exc!r}")
                return
            if message is grpc.aio.EOF:
                self.lose("stream closed by the worker")
                return
            self.telemetry.count("worker_to_server", _kind(message), "receiver", message, _payload(message))
            kind = message.WhichOneof("body")
            if kind == "feedback":
                await self._on_feedback(message.feedback)
            elif kind == "swap_report":
                self._on_swap_report(message.swap_report)
            elif kind == "model_part":
                await self._on_model_part(message.model_part)
            elif kind == "local_round_done":
                await self._on_local_round_done(message.local_round_done)
            elif kind == "heartbeat":
                continue
            else:
                await self._reject(0, "protocol", f"unexpected {kind!r} message after join")

    async def _reject(self, iteration: int, reason: str, detail: str) -> None:
        log.warning("%s: rejected input at iteration %d: %s", self.worker_id, iteration, detail)
        self.telemetry.rejected.labels(reason).inc()
        try:
            await self.send(pb.ServerMessage(rejection=pb.Rejection(
                iteration=iteration, code=INVALID_ARGUMENT, reason=reason, message=detail)))
        except WorkerLost:
            pass

    async def _on_feedback(self, feedback: pb.Feedback) -> None:
        future = self._steps.get(feedback.iteration)
        if future is None or future.done():
            await self._reject(feedback.iteration, "iteration", f"no batch pending for iteration {feedback.iteration}")
            return
        shape = (self.config.batch_size, *self.config.model.sample_shape)
        try:
            if not feedback.HasField("gradient"):
                raise codec.InvalidTensor("missing", "feedback without gradient")
            gradient = codec.decode_packed(feedback.gradient, shape=shape, wire_dtype=self.config.wire_dtype,
                                           field="gradient")
        except codec.InvalidTensor as exc:
            await self._reject(feedback.iteration, exc.reason, str(exc))
            future.set_exception(InputRejected(exc.reason, str(exc)))
            return
        s = feedback.stats
        future.set_result(StepResult(gradient, s.disc_loss, s.gen_loss, s.real_accuracy, s.fake_accuracy))

    async def _fail_round(self, round_: int, reason: str, detail: str) -> None:
        self._discarding = round_
        await self._reject(round_, reason, detail)
        future = self._rounds.get(round_)
        if future is not None and not future.done():
            future.set_exception(InputRejected(reason, detail))
        self._returning = {}

    async def _on_model_part(self, part: pb.ModelPart) -> None:
        if part.round == self._discarding:
            return
        assembler = self._returning.get((part.round, part.model))
        if assembler is None:
            await self._reject(part.round, "round", f"no {part.model!r} expected for round {part.round}")
            return
        try:
            assembler.accept(part)
        except codec.InvalidTensor as exc:
            await self._fail_round(part.round, exc.reason, f"{part.model}: {exc}")

    async def _on_local_round_done(self, done: pb.LocalRoundDone) -> None:
        if done.round == self._discarding:
            return
        future = self._rounds.get(done.round)
        if future is None or future.done():
            await self._reject(done.round, "round", f"no local round {done.round} pending")
            return
        try:
            states = {model: self._returning[(done.round, model)].finish() for model in ("generator", "discriminator")}
        except (codec.InvalidTensor, KeyError) as exc:
            await self._fail_round(done.round, getattr(exc, "reason", "protocol"), f"models of round {done.round}: {exc}")
            return
        stats = [{"gen_loss": s.gen_loss, "disc_loss": s.disc_loss, "real_accuracy": s.real_accuracy,
                  "fake_accuracy": s.fake_accuracy} for s in done.stats]
        sent = sum(t.numel() * t.element_size() for state in states.values() for t in state.values())
        future.set_result(LocalRoundResult(states["generator"], states["discriminator"], stats, sent))

    def _on_swap_report(self, report: pb.SwapReport) -> None:
        future = self._swaps.get(report.round)
        if future is not None and not future.done():
            self.swap_message_bytes += report.sent_message_bytes
            future.set_result(SwapReport(report.round, report.sent, report.received, report.sent_payload_bytes,
                                         report.error))


class JoinRefused(Exception):
    def __init__(self, code: grpc.StatusCode, detail: str):
        super().__init__(detail)
        self.code = code
        self.detail = detail


class Coordinator(coordinator_pb2_grpc.CoordinatorServicer):
    """Admits up to `config.workers` workers, one per shard, until the run starts."""

    def __init__(self, config: TrainingConfig, *, telemetry: Telemetry | None = None, heartbeat_interval: float = 5.0,
                 swap_timeout: float = 60.0, liveness_timeout: float = 60.0, join_read_timeout: float = 30.0,
                 algorithm: str = "mdgan", model_layouts: dict[str, dict] | None = None,
                 class_names: tuple[str, ...] | None = None):
        self.config = config
        # The run's class names: declared (--classes) or set by the first site with class folders.
        self.classes = RunClasses(class_names, config.model.num_classes, config.model.conditional)
        self.algorithm = algorithm
        self.model_layouts = model_layouts
        self.telemetry = telemetry or Telemetry("server")
        self.telemetry.workers_expected.set(config.workers)
        self.telemetry.run_iterations.set(config.iterations)
        self.heartbeat_interval = heartbeat_interval
        self.swap_timeout = swap_timeout
        self.liveness_timeout = liveness_timeout
        self.join_read_timeout = join_read_timeout
        self.workers: dict[int, GrpcWorker] = {}  # shard index -> handle
        self.encoder = BatchEncoder()
        self.started = False
        self._changed = asyncio.Event()

    async def wait_for_workers(self, timeout: float) -> list[GrpcWorker]:
        """Block until every shard has a live worker; then no one else is admitted."""
        deadline = time.monotonic() + timeout
        while len(self._live()) < self.config.workers:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{len(self._live())} of {self.config.workers} workers joined within {timeout:.0f} s")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except asyncio.TimeoutError:
                pass
        self.started = True
        handles = sorted(self._live(), key=lambda w: w.shard_index)
        book = {w.worker_id: w.peer_address for w in handles}
        for w in handles:
            w.address_book = book
        return handles

    def _live(self) -> list[GrpcWorker]:
        return [w for w in self.workers.values() if not w.closed.is_set()]

    def _admit(self, join: pb.Join) -> tuple[int, int]:
        """(shard index, shard size) for a joining worker; raises JoinRefused."""
        cfg = self.config
        if self.started:
            raise JoinRefused(grpc.StatusCode.FAILED_PRECONDITION, "the run has started; it takes no new workers")
        self._check_data(join)
        if cfg.workers > 1 and not join.peer_address:
            raise JoinRefused(grpc.StatusCode.INVALID_ARGUMENT, "a peer address is needed for the discriminator swap")
        taken = {i for i, w in self.workers.items() if not w.closed.is_set()}
        if join.HasField("shard_index"):
            index, size = join.shard_index, join.shard_size
            if index >= cfg.workers:
                raise JoinRefused(grpc.StatusCode.INVALID_ARGUMENT, f"shard index {index} >= workers {cfg.workers}")
            if index in taken:
                raise JoinRefused(grpc.StatusCode.ALREADY_EXISTS, f"shard {index} already has a worker")
        else:
            free = [i for i in range(cfg.workers) if i not in taken]
            if not free:
                raise JoinRefused(grpc.StatusCode.RESOURCE_EXHAUSTED, f"all {cfg.workers} shards have a worker")
            if join.own_data:  # a site: its slot is the lowest free one, its m is all of its data
                index, size = free[0], join.shard_size
            elif join.dataset_size < cfg.workers:
                raise JoinRefused(grpc.StatusCode.INVALID_ARGUMENT, f"a dataset of {join.dataset_size} samples cannot "
                                                                    f"be cut into {cfg.workers} shards")
            else:
                index = free[0]
                size = shard_sizes(join.dataset_size, cfg.workers)[index]
        if size < cfg.batch_size:
            raise JoinRefused(grpc.StatusCode.INVALID_ARGUMENT, f"shard of {size} samples < batch size {cfg.batch_size}")
        classes = tuple(join.class_names) if join.class_names else (() if join.own_data and not join.num_classes
                                                                    else None)
        why = self.classes.check(classes, join.num_classes)  # last: a refused join must not fix the run's classes
        if why:
            raise JoinRefused(grpc.StatusCode.INVALID_ARGUMENT, f"this worker's classes do not fit the run: {why}")
        return index, size

    def _check_data(self, join: pb.Join) -> None:
        """The worker's samples fit the model: the same flat shape, or images it can resize to the model's."""
        model = self.config.model
        malformed = check_class_names(tuple(join.class_names))
        if malformed:
            raise JoinRefused(grpc.StatusCode.INVALID_ARGUMENT, f"bad class names: {malformed}")
        if join.image_shape:
            image = tuple(join.image_shape)
            try:
                target = model_image_shape(model.sample_shape)
            except ValueError as exc:
                raise JoinRefused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
            if not resizable(image, target):
                raise JoinRefused(grpc.StatusCode.INVALID_ARGUMENT, (
                    f"this worker's images of shape {image} (C, H, W) cannot be resized to the model's {target}: "
                    "not 1 or 3 channels, or another aspect ratio"))
        elif tuple(join.sample_shape) != tuple(model.sample_shape):
            raise JoinRefused(grpc.StatusCode.INVALID_ARGUMENT, (
                f"data of shape {tuple(join.sample_shape)} does not fit the model's samples "
                f"{tuple(model.sample_shape)}"))
        if not join.own_data and join.num_classes != model.num_classes:
            raise JoinRefused(grpc.StatusCode.INVALID_ARGUMENT, (
                f"data with {join.num_classes} classes does not fit the model ({model.num_classes} classes)"))

    async def Train(self, request_iterator, context: grpc.aio.ServicerContext) -> None:
        try:
            first = await asyncio.wait_for(context.read(), self.join_read_timeout)
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "no join message in time")
        if first is grpc.aio.EOF or first.WhichOneof("body") != "join":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message must be a join")
        self.telemetry.count("worker_to_server", "control", "receiver", first)
        join = first.join
        try:
            index, size = self._admit(join)
        except JoinRefused as refused:
            log.warning("join refused (%s): %s", context.peer(), refused.detail)
            await context.abort(refused.code, refused.detail)
        worker = GrpcWorker(index, size, join, context, self.config, self.telemetry, self.liveness_timeout,
                            self.model_layouts, self.encoder)
        self.workers[index] = worker
        self.telemetry.joins.inc()
        self.telemetry.workers_alive.set(len(self._live()))
        self._changed.set()
        log.info("%s joined from %s (%s of %d samples, peer %s)", worker.worker_id, context.peer(),
                 "its own data" if join.own_data else "a shard", size, join.peer_address)
        spec = codec.spec_from_config(self.config, self.algorithm)
        spec.class_names.extend(self.classes.names or ())
        await worker.send(pb.ServerMessage(welcome=pb.Welcome(
            worker_id=worker.worker_id, shard_index=index, spec=spec,
            heartbeat_interval_ms=int(self.heartbeat_interval * 1000), swap_timeout_ms=int(self.swap_timeout * 1000))))
        reader = asyncio.create_task(worker.read_loop())
        beats = asyncio.create_task(self._heartbeats(worker))
        try:
            await worker.closed.wait()
        finally:  # also on cancellation, when the worker's connection drops
            worker.lose("stream ended")
            self._changed.set()
            self.telemetry.workers_alive.set(len(self._live()))
            reader.cancel()
            beats.cancel()

    async def _heartbeats(self, worker: GrpcWorker) -> None:
        # Only when idle: a busy stream already tells the worker the server is alive.
        while not worker.closed.is_set():
            await asyncio.sleep(self.heartbeat_interval)
            if time.monotonic() - worker.last_write >= self.heartbeat_interval:
                try:
                    await worker.send(pb.ServerMessage(heartbeat=pb.Heartbeat(unix_ms=int(time.time() * 1000))))
                except WorkerLost:
                    return
