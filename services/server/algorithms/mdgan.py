"""MD-GAN on the server: the library's WorkerHandle over a worker's stream, and the run around
mdgan.algorithms.mdgan.trainer.Trainer. Speaks batches/feedback, swap orders/reports/cancels, checkpoints."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from mdgan.algorithms.mdgan.trainer import (COPY, SWAP, SwapOrder, SwapReport, Trainer, TrainerHooks, TrainerPlan,
                                           WorkerHandle)
from mdgan.algorithms.base import InputRejected, IterationRecord
from mdgan.config import TrainingConfig
from mdgan import privacy
from mdgan.gan import WorkerBatch
from mdgan.step_results import StepResult
from mdgan.algorithms.mdgan.checkpoints import ServerCheckpoints
from services.common import codec
from services.common.proto import coordinator_pb2 as pb
from services.common import wire
from services.server.connection import StreamHandle, WorkerConnection
from services.server.context import ServerContext, until
from services.common.settings import algorithm_options

log = logging.getLogger("mdgan.server")
# Resumed after the run's end: a worker still reconnecting knocks at least every 10 s (its backoff's
# cap), so this long is enough to find every one that has not heard the run is over.
FINAL_REJOIN_SECONDS = 15.0


@dataclass
class MDGANRun:
    """What an MD-GAN run's handles share."""

    config: TrainingConfig
    run_id: str = ""
    encoder: codec.BatchEncoder = field(default_factory=codec.BatchEncoder)
    address_book: dict[str, str] = field(default_factory=dict)  # worker id -> peer address
    identity_book: dict[str, str] = field(default_factory=dict)  # worker id -> identity
    relay_book: dict[str, bytes] = field(default_factory=dict)  # worker id -> certificate, of relayed workers
    swap_message_bytes: int = 0  # serialized bytes the workers report pushing to peers, all handles


class GrpcWorker(StreamHandle, WorkerHandle):
    """MD-GAN's WorkerHandle for a worker on the other end of a stream."""

    algorithm = "mdgan"
    peer_to_peer = True  # the workers push their discriminators to each other's Peer service

    def __init__(self, connection: WorkerConnection, run: MDGANRun, needs_copy: bool = False):
        super().__init__(connection)
        self.run = run
        self.config = run.config
        self.needs_copy = needs_copy
        self.encoder = run.encoder  # shared by the run's workers
        self._steps = connection.answers("step")  # iteration -> Future[StepResult]
        # Swap rounds and copy boundaries share this map: a copy happens before an iteration and a
        # swap (or a background round's install) after it, each awaited to the end, so their numbers
        # are never pending at once.
        self._swaps = connection.answers("swap")
        self._checkpoints = connection.answers("checkpoint")
        run.address_book[self.worker_id] = connection.peer_address
        run.identity_book[self.worker_id] = self.identity
        if connection.relayed_certificate is not None:
            run.relay_book[self.worker_id] = connection.relayed_certificate
        else:
            run.relay_book.pop(self.worker_id, None)

    @classmethod
    def run_state(cls, coordinator) -> MDGANRun:
        return MDGANRun(coordinator.config, coordinator.run_id)

    def receivers(self):
        return {"feedback": self._on_feedback, "swap_report": self._on_swap_report,
                "checkpoint_done": self._on_checkpoint_done}

    traffic = staticmethod(wire.mdgan)  # (kind, payload bytes) of its messages, as both sides count them

    # -- the training loop's calls -----------------------------------------------------------
    async def step(self, iteration: int, batch: WorkerBatch) -> StepResult:
        return await (await self.send_step(iteration, batch))

    async def send_step(self, iteration: int, batch: WorkerBatch) -> asyncio.Future:
        message = self.encoder.message(iteration, batch, self.config.wire_dtype)  # shared by the workers of a batch
        return await self.connection.post(self._steps, iteration, message)

    async def swap(self, order: SwapOrder) -> SwapReport:
        return await self.connection.request(self._swaps, order.swap_round, self._swap_order(order))

    def _swap_order(self, order: SwapOrder, deferred: bool = False) -> pb.ServerMessage:
        book, identities = self.run.address_book, self.run.identity_book
        return pb.ServerMessage(swap_order=pb.SwapOrder(
            round=order.swap_round, send_to_worker=order.send_to,
            send_to_address=book.get(order.send_to, ""), receive_from_worker=order.receive_from,
            receive_from_identity=identities.get(order.receive_from, ""),
            send_to_identity=identities.get(order.send_to, ""), kind=order.kind, deferred=deferred,
            send_via_relay=order.send_to in self.run.relay_book,
            send_to_certificate=self.run.relay_book.get(order.send_to, b"")))

    async def send_swap(self, order: SwapOrder) -> None:
        """A background round: the order alone (the worker snapshots its D before the next batches,
        which follow on the same stream, and reports at swap_install)."""
        await self.connection.send(self._swap_order(order, deferred=True))

    async def install_swap(self, order: SwapOrder) -> SwapReport:
        return await self.connection.request(self._swaps, order.swap_round, pb.ServerMessage(
            swap_install=pb.SwapInstall(round=order.swap_round)))

    async def checkpoint(self, iteration: int) -> str | None:
        return await self.connection.request(self._checkpoints, iteration, pb.ServerMessage(
            checkpoint=pb.CheckpointOrder(iteration=iteration, run_id=self.run.run_id)))

    async def cancel_swap(self, swap_round: int, sender: str, reason: str, kind: str = SWAP) -> None:
        await self.connection.send(pb.ServerMessage(swap_cancel=pb.SwapCancel(
            round=swap_round, sender_worker=sender, reason=reason, copy=kind == COPY)))

    async def cancel_push(self, swap_round: int, receiver: str, reason: str) -> None:
        await self.connection.send(pb.ServerMessage(swap_cancel=pb.SwapCancel(
            round=swap_round, receiver_worker=receiver, reason=reason)))

    # -- the worker's messages ---------------------------------------------------------------
    async def _on_feedback(self, feedback: pb.Feedback) -> None:
        future = self._steps.get(feedback.iteration)
        if future is None or future.done():
            await self.connection.reject(feedback.iteration, "iteration",
                                         f"no batch pending for iteration {feedback.iteration}")
            return
        shape = (self.config.batch_size, *self.config.model.sample_shape)
        try:
            if not feedback.HasField("gradient"):
                raise codec.InvalidTensor("missing", "feedback without gradient")
            gradient = codec.decode_packed(feedback.gradient, shape=shape, wire_dtype=self.config.wire_dtype,
                                           field="gradient")
        except codec.InvalidTensor as exc:
            await self.connection.reject(feedback.iteration, exc.reason, str(exc))
            future.set_exception(InputRejected(exc.reason, str(exc)))
            return
        s = feedback.stats
        private = self.config.privacy.enabled and s.delta > 0  # (a site's spent budget, by its own ledger)
        # what a private site withholds is absent from its message (read as 0): NaN here, as in one process
        future.set_result(privacy.released(StepResult(
            gradient, s.disc_loss, s.gen_loss, s.real_accuracy, s.fake_accuracy,
            epsilon=s.epsilon if private else float("nan"), delta=s.delta if private else float("nan"),
            fixed_noise=private and s.fixed_noise), self.config.privacy))

    async def _on_swap_report(self, report: pb.SwapReport) -> None:
        future = self._swaps.get(report.round)
        if future is not None and not future.done():
            self.run.swap_message_bytes += report.sent_message_bytes
            future.set_result(SwapReport(report.round, report.sent, report.received, report.sent_payload_bytes,
                                         report.error, report.refused, report.relayed_bytes))

    async def _on_checkpoint_done(self, done: pb.CheckpointDone) -> None:
        future = self._checkpoints.get(done.iteration)
        if future is None or future.done():
            await self.connection.reject(done.iteration, "iteration", f"no checkpoint pending for {done.iteration}")
        else:
            future.set_result(None if done.ok else (done.error or "the worker could not save its state"))


class MDGANServer:
    """An MD-GAN run on the server: mdgan.algorithms.mdgan.trainer.Trainer over the roster's GrpcWorkers."""

    handle = GrpcWorker

    @staticmethod
    def check(args, run) -> None:
        """Every option works with MD-GAN."""

    def __init__(self, ctx: ServerContext):
        self.ctx = ctx
        args, telemetry, recorder = ctx.args, ctx.telemetry, ctx.recorder
        self.options = algorithm_options("mdgan", args, ctx.config)  # the swap check its workers apply

        def on_swap(record: dict) -> None:
            recorder.swap(record)
            if "round" in record:
                complete = all(w["sent"] and w["received"] for w in record["workers"].values())
                telemetry.swaps.labels("complete" if complete else "incomplete").inc()

        def save_checkpoint(iteration: int, wrote_all: bool) -> None:
            ctx.saver.save(iteration, wrote_all, ctx.generator, self.trainer, recorder)
            telemetry.checkpoints.labels("complete" if wrote_all else "incomplete").inc()

        plan = TrainerPlan(step_timeout=args.step_timeout, swap_timeout=args.swap_timeout + args.step_timeout,
                           checkpoint_every=args.checkpoint_every, swap_lag=self.options.swap_lag,
                           pipeline_depth=self.options.pipeline_depth)
        hooks = TrainerHooks(on_iteration=self._on_iteration, on_swap=on_swap, save_checkpoint=save_checkpoint)
        self.trainer = Trainer(ctx.config, ctx.generator, roster=ctx.roster, plan=plan, hooks=hooks)
        if ctx.run.state is not None:
            ServerCheckpoints.restore(ctx.run.state, ctx.generator, self.trainer, recorder)

    def describe(self, spec: pb.TrainingSpec) -> None:
        """The Welcome's spec carries the swap check to the workers."""
        codec.describe_options(spec, "mdgan", self.options)

    def summary_fields(self) -> dict:
        """summary.json's record of MD-GAN's options, as `mdgan simulate` writes it."""
        return {"mdgan": self.options.summary(self.ctx.config)}

    def _on_iteration(self, record: IterationRecord) -> None:
        self.ctx.on_iteration(record, len(self.trainer.active))

    def swap_round(self) -> int:
        """Swap rounds done so far (a joining worker's mailbox starts after them)."""
        return self.trainer.swaps

    @property
    def stop_requested(self) -> bool:
        return self.trainer.stop_requested

    async def run(self, coordinator, stopping: asyncio.Event):
        """(RunResult, wall seconds); SystemExit when a signal stopped it (checkpointed if it could)."""
        ctx, trainer = self.ctx, self.trainer
        if trainer.finished:  # a server stopped between the run's end and its outputs: only those are left
            log.info("run %s had finished all %d iterations: writing its outputs", ctx.run.run_id, trainer.completed)
            await until(trainer.wait_to_finish(min(ctx.args.join_timeout, FINAL_REJOIN_SECONDS)), stopping)
        else:
            await until(trainer.wait_to_start(ctx.args.join_timeout), stopping)
        ctx.recorder.started = ctx.clock()  # the run's wall time starts with its first iteration
        result = None
        try:
            result = await until(trainer.run(), stopping, lambda: setattr(trainer, "stop_requested", True),
                                 ctx.args.stop_grace)
        finally:
            wall = ctx.recorder.close(result.iterations if result else None)
        if result.stopped_early and trainer.stop_requested:
            log.info("stopped at iteration %d by a signal; resume with --resume", result.iterations)
            raise SystemExit("terminated by signal")
        return result, wall

    @staticmethod
    def worker_to_worker_bytes(coordinator) -> int:
        return coordinator.run_state.swap_message_bytes
