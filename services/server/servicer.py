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

from mdgan.baselines import FederatedWorker, LocalRoundResult
from mdgan.cluster import RUN_FINISHED, InputRejected, SwapOrder, SwapReport, WorkerHandle, WorkerLost
from mdgan.config import TrainingConfig
from mdgan.data import shard_sizes
from mdgan.sites import RunClasses, check_class_names, model_image_shape, resizable
from mdgan.mdgan import StepResult, WorkerBatch
from mdgan.roster import RejoinPlan, Roster, SlotRefused
from services.common import codec, pki
from services.common.rpc import MalformedMessage, RateLimitedWarnings
from services.common.telemetry import Telemetry
from services.common.tls import peer_certificate
from services.common.proto import coordinator_pb2 as pb
from services.common.proto import coordinator_pb2_grpc

log = logging.getLogger("mdgan.server")

INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]  # 3, the google.rpc.Code value
MAX_PENDING_JOINS = 32  # streams that opened but have not been admitted yet (each waits for its join)
MAX_ADDRESS_CHARS = 255
MAX_SAMPLES = 1 << 40  # a bound on shard and dataset sizes: beyond it a number is nonsense, not data


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


class GrpcWorker(WorkerHandle, FederatedWorker):
    def __init__(self, shard_index: int, shard_size: int, join: pb.Join, context: grpc.aio.ServicerContext,
                 config: TrainingConfig, telemetry: Telemetry, liveness_timeout: float,
                 model_layouts: dict[str, dict] | None = None, encoder: codec.BatchEncoder | None = None,
                 identity: str = ""):
        self.worker_id = f"worker-{shard_index}"
        self.identity = identity or self.worker_id  # who holds the shard (certificate name under mTLS)
        self.malformed: str | None = None  # the stream carried bytes that do not parse
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
        # Swap rounds and copy boundaries share this map: a copy happens before an iteration and a
        # swap after it, each awaited to the end, so their numbers are never pending at once.
        self._swaps: dict[int, asyncio.Future] = {}
        self._checkpoints: dict[int, asyncio.Future] = {}
        self.run_id = ""
        self.address_book: dict[str, str] = {}  # worker id -> peer address, filled by the Coordinator
        self.identity_book: dict[str, str] = {}  # worker id -> identity, filled by the Coordinator
        # FL-GAN: the models coming back in the current round, checked against these layouts
        self.model_layouts = model_layouts or {}
        self._rounds: dict[int, asyncio.Future] = {}
        self._returning: dict[tuple[int, str], codec.StateAssembler] = {}
        self._discarding = -1  # a round already refused: the rest of its parts are dropped quietly
        self.encoder = encoder or codec.BatchEncoder()  # shared by the run's workers
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
        message = self.encoder.message(iteration, batch, self.config.wire_dtype)  # shared by the workers of a batch
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
                send_to_address=self.address_book.get(order.send_to, ""), receive_from_worker=order.receive_from,
                receive_from_identity=self.identity_book.get(order.receive_from, ""),
                send_to_identity=self.identity_book.get(order.send_to, ""), kind=order.kind)))
            return await future
        finally:
            self._swaps.pop(order.swap_round, None)

    async def checkpoint(self, iteration: int) -> str | None:
        future = asyncio.get_running_loop().create_future()
        self._checkpoints[iteration] = future
        try:
            await self.send(pb.ServerMessage(checkpoint=pb.CheckpointOrder(iteration=iteration, run_id=self.run_id)))
            return await future
        finally:
            self._checkpoints.pop(iteration, None)

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
        for future in [*self._steps.values(), *self._swaps.values(), *self._rounds.values(),
                       *self._checkpoints.values()]:
            if not future.done():
                future.set_exception(WorkerLost(f"{self.worker_id}: {reason}"))
        self.closed.set()

    # -- receiving ---------------------------------------------------------------------------
    async def read_loop(self) -> None:
        while not self.closed.is_set():
            try:
                async with asyncio.timeout(self.liveness_timeout):  # (wait_for would make a task per read)
                    message = await self.context.read()
            except asyncio.TimeoutError:
                self.lose(f"silent for {self.liveness_timeout:.0f} s")
                return
            except MalformedMessage as exc:  # garbage on an admitted stream: end it with INVALID_ARGUMENT
                self.telemetry.rejected.labels("malformed").inc()
                self.malformed = str(exc)
                self.lose(f"sent a message that does not parse: {exc}")
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
            elif kind == "checkpoint_done":
                done = message.checkpoint_done
                future = self._checkpoints.get(done.iteration)
                if future is None or future.done():
                    await self._reject(done.iteration, "iteration", f"no checkpoint pending for {done.iteration}")
                else:
                    future.set_result(None if done.ok else (done.error or "the worker could not save its state"))
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
    """Admits workers into the roster's slots, at any time (they take part from the next iteration
    boundary), and refuses those of another run or another identity.

    Under mutual TLS (`authenticated`) a worker's identity is the name in its client certificate,
    which gRPC has verified against the run's CA; it must be a worker certificate (or be on
    `allowed_workers`). With --insecure it is the name the worker claims in its Join. The roster
    binds each slot to the first identity that holds it.
    """

    def __init__(self, config: TrainingConfig, *, telemetry: Telemetry | None = None, heartbeat_interval: float = 5.0,
                 swap_timeout: float = 60.0, liveness_timeout: float = 60.0, join_read_timeout: float = 30.0,
                 algorithm: str = "mdgan", model_layouts: dict[str, dict] | None = None, roster: Roster | None = None,
                 run_id: str = "", swap_round=lambda: 0, class_names: tuple[str, ...] | None = None,
                 authenticated: bool = False, allowed_workers: list[str] | None = None):
        self.config = config
        self.authenticated = authenticated
        self.allowed_workers = set(allowed_workers) if allowed_workers else None
        self._pending_joins = 0
        self.warnings = RateLimitedWarnings(log)  # a flood of bad joins makes a few lines, not a flood
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
        self.roster = roster or Roster(config.workers)
        self.run_id = run_id
        self.swap_round = swap_round  # swap rounds done so far (the Trainer's count)
        self.workers: dict[int, GrpcWorker] = {}  # slot -> the latest handle (for the summary's byte counts)
        self.address_book: dict[str, str] = {}  # worker id -> peer address, shared by every handle
        self.identity_book: dict[str, str] = {}  # worker id -> identity, shared by every handle
        self.departed_swap_bytes = 0  # swap bytes reported by handles since replaced
        self.encoder = codec.BatchEncoder()

    async def wait_for_workers(self, timeout: float) -> list[GrpcWorker]:
        """Block until every slot has a live worker (FL-GAN, whose rounds take a fixed set)."""
        if not await self.roster.wait_for(self.config.workers, timeout):
            raise TimeoutError(f"{len(self._live())} of {self.config.workers} workers joined within {timeout:.0f} s")
        self.roster.started = True
        return self._live()

    def _live(self) -> list[GrpcWorker]:
        return self.roster.alive()

    def identify(self, join: pb.Join, context: grpc.aio.ServicerContext) -> str | None:
        """The joining worker's identity; None: unnamed (insecure mode only; named after its shard)."""
        if not self.authenticated:
            if join.name and not pki.NAME_PATTERN.match(join.name):
                raise JoinRefused(grpc.StatusCode.INVALID_ARGUMENT, f"{join.name[:64]!r} is not a valid worker name")
            return join.name or None
        identity, role = peer_certificate(context)
        if identity is None:  # cannot happen with require_client_auth; refuse rather than trust
            raise JoinRefused(grpc.StatusCode.UNAUTHENTICATED, "no client certificate")
        if self.allowed_workers is not None:
            if identity not in self.allowed_workers:
                raise JoinRefused(grpc.StatusCode.PERMISSION_DENIED, f"{identity!r} is not on --allowed-workers")
        elif role != pki.ROLE_WORKER:
            raise JoinRefused(grpc.StatusCode.PERMISSION_DENIED,
                              f"{identity!r} holds a {role or 'role-less'} certificate, not a worker's "
                              f"(OU={pki.ROLE_WORKER}); or list it in --allowed-workers")
        return identity

    def _admit(self, join: pb.Join, identity: str | None) -> tuple[int, int, str, RejoinPlan]:
        """(slot, shard size, identity, how it gets its discriminator) for a joining worker; raises JoinRefused."""
        cfg = self.config
        if join.run_id and self.run_id and join.run_id != self.run_id:
            raise JoinRefused(grpc.StatusCode.FAILED_PRECONDITION, (
                f"this worker belongs to run {join.run_id!r}, but this server runs run {self.run_id!r}; "
                f"point it at its own run's server, or empty its --state-dir to join run {self.run_id!r}"))
        if self.algorithm == "flgan" and self.roster.started:
            raise JoinRefused(grpc.StatusCode.FAILED_PRECONDITION, "an FL-GAN run takes no workers once it started")
        if len(join.peer_address) > MAX_ADDRESS_CHARS or len(join.sample_shape) > 8 or len(join.image_shape) > 8 \
                or join.shard_size > MAX_SAMPLES or join.dataset_size > MAX_SAMPLES:
            raise JoinRefused(grpc.StatusCode.INVALID_ARGUMENT, "absurd join: address, shape or sizes out of bounds")
        self._check_data(join)
        if cfg.workers > 1 and not join.peer_address:
            raise JoinRefused(grpc.StatusCode.INVALID_ARGUMENT, "a peer address is needed for the discriminator swap")
        if join.HasField("shard_index"):
            index, size = join.shard_index, join.shard_size
            if index >= cfg.workers:
                raise JoinRefused(grpc.StatusCode.INVALID_ARGUMENT, f"shard index {index} >= workers {cfg.workers}")
        else:
            held = self.roster.slot_bound_to(identity) if identity is not None else None
            taken = {self.roster.slot_of(w) for w in self.roster.alive()}

            def unbound(i: int) -> bool:  # (unnamed workers cannot be told apart: any may take an unnamed one's)
                owner = self.roster.bindings.get(i)
                return owner is None or (identity is None and owner == f"worker-{i}")

            # an identity coming back gets its own slot; others get the lowest slot nobody holds
            free = [held] if held is not None else [i for i in range(cfg.workers) if i not in taken and unbound(i)]
            if not free:
                raise JoinRefused(grpc.StatusCode.RESOURCE_EXHAUSTED, f"all {cfg.workers} shards have a worker")
            index = free[0]
            if join.own_data:  # a site: its m is all of its data
                size = join.shard_size
            elif join.dataset_size < cfg.workers:
                raise JoinRefused(grpc.StatusCode.INVALID_ARGUMENT, f"a dataset of {join.dataset_size} samples cannot "
                                                                    f"be cut into {cfg.workers} shards")
            else:
                size = shard_sizes(join.dataset_size, cfg.workers)[index]
        if size < cfg.batch_size:
            raise JoinRefused(grpc.StatusCode.INVALID_ARGUMENT, f"shard of {size} samples < batch size {cfg.batch_size}")
        identity = identity or f"worker-{index}"  # an unnamed worker (--insecure) is named after its slot
        try:
            self.roster.claim(index, identity)
        except SlotRefused as refused:
            code = {"taken_by_other": grpc.StatusCode.PERMISSION_DENIED, "busy": grpc.StatusCode.ALREADY_EXISTS,
                    "full": grpc.StatusCode.RESOURCE_EXHAUSTED}.get(refused.kind, grpc.StatusCode.INVALID_ARGUMENT)
            raise JoinRefused(code, f"shard {index}: {refused}") from None
        classes = tuple(join.class_names) if join.class_names else (() if join.own_data and not join.num_classes
                                                                    else None)
        why = self.classes.check(classes, join.num_classes)  # last: a refused join must not fix the run's classes
        if why:
            raise JoinRefused(grpc.StatusCode.INVALID_ARGUMENT, f"this worker's classes do not fit the run: {why}")
        # Only what this run saved counts as the worker's state.
        same_run = bool(join.run_id) and join.run_id == self.run_id
        plan = self.roster.rejoin_plan(list(join.checkpoints) if same_run else [],
                                       join.trained_iteration if same_run else 0)
        return index, size, identity, plan

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
        if self._pending_joins >= MAX_PENDING_JOINS:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many joins in progress; try again")
        self._pending_joins += 1
        try:
            join, index, size, identity, plan = await self._join(context)
        finally:
            self._pending_joins -= 1
        worker = GrpcWorker(index, size, join, context, self.config, self.telemetry, self.liveness_timeout,
                            self.model_layouts, self.encoder, identity=identity)
        worker.run_id = self.run_id
        worker.needs_copy = plan.copy
        worker.address_book = self.address_book
        worker.identity_book = self.identity_book
        if index in self.workers:
            self.departed_swap_bytes += self.workers[index].swap_message_bytes
        self.workers[index] = worker
        self.roster.arrive(index, identity, worker)  # takes part from the next iteration boundary
        self.address_book[worker.worker_id] = join.peer_address
        self.telemetry.joins.inc()
        self.telemetry.workers_alive.set(len(self._live()))
        self.identity_book[worker.worker_id] = worker.identity
        log.info("%s joined as %r from %s (%s of %d samples, peer %s)%s", worker.worker_id, worker.identity,
                 context.peer(), "its own data" if join.own_data else "a shard", size, join.peer_address,
                 f": restores its state of iteration {plan.restore}" if plan.restore
                 else ": takes a copy of a peer's discriminator" if plan.copy else "")
        spec = codec.spec_from_config(self.config, self.algorithm)
        spec.class_names.extend(self.classes.names or ())
        # every identity bound in this run: a discriminator one of them pushes early is kept for the order
        members = sorted(set(self.roster.bindings.values()) | {w.identity for w in self._live()})
        try:
            await worker.send(pb.ServerMessage(welcome=pb.Welcome(
                worker_id=worker.worker_id, shard_index=index, spec=spec,
                heartbeat_interval_ms=int(self.heartbeat_interval * 1000), swap_timeout_ms=int(self.swap_timeout * 1000),
                run_id=self.run_id, swap_round=self.swap_round(), restore_iteration=plan.restore, copy=plan.copy,
                identity=worker.identity, members=members)))
        except WorkerLost:
            self.roster.depart(worker)
            return
        reader = asyncio.create_task(worker.read_loop())
        beats = asyncio.create_task(self._heartbeats(worker))
        try:
            await worker.closed.wait()
        finally:  # also on cancellation, when the worker's connection drops
            worker.lose("stream ended")
            self.roster.depart(worker)
            self.telemetry.workers_alive.set(len(self._live()))
            reader.cancel()
            beats.cancel()
        if worker.malformed is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed message: {worker.malformed}")

    async def _join(self, context: grpc.aio.ServicerContext) -> tuple[pb.Join, int, int, str, RejoinPlan]:
        """Read and admit the first message; every refusal ends the call with its status."""
        try:
            first = await asyncio.wait_for(context.read(), self.join_read_timeout)
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "no join message in time")
        if first is grpc.aio.EOF or first.WhichOneof("body") != "join":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message must be a join")
        self.telemetry.count("worker_to_server", "control", "receiver", first)
        join = first.join
        try:
            index, size, identity, plan = self._admit(join, self.identify(join, context))
        except JoinRefused as refused:
            self.warnings.warn(refused.code.name, "join refused (%s, %s): %s", context.peer(), refused.code.name,
                               refused.detail)
            if refused.code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
                self.telemetry.rejected.labels("identity").inc()
            await context.abort(refused.code, refused.detail)
        return join, index, size, identity, plan

    async def _heartbeats(self, worker: GrpcWorker) -> None:
        # Only when idle: a busy stream already tells the worker the server is alive.
        while not worker.closed.is_set():
            await asyncio.sleep(self.heartbeat_interval)
            if time.monotonic() - worker.last_write >= self.heartbeat_interval:
                try:
                    await worker.send(pb.ServerMessage(heartbeat=pb.Heartbeat(unix_ms=int(time.time() * 1000))))
                except WorkerLost:
                    return
