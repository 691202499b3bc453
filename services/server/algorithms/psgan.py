"""The parameter-server GAN on the server: the library's ReplicaHandle over a worker's
stream, and the run around mdgan.algorithms.psgan.PSGANTrainer.

Speaks ReplicaPart / ReplicaRound down and ReplicaPart / ReplicaGradients up (protos/mdgan/v1/psgan.proto).
Weights and gradients are megabytes: they travel as a StateHeader and raw chunks of at most 1 MiB,
as FL-GAN's model parts do, and every returning set is checked against the model's layout (names,
shapes, dtypes, byte count, finiteness) before a byte of it is kept."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mdgan.algorithms.psgan import (PSGANTrainer, GradientOrder, GradientReply, ParameterServer,
                                    ReplicaHandle)
from mdgan.algorithms.base import InputRejected
from mdgan.models import build_discriminator, build_generator
from services.common import codec
from services.common.proto import coordinator_pb2 as pb
from services.common.proto import psgan_pb2
from services.common import wire
from services.server.connection import StreamHandle, WorkerConnection
from services.server.algorithms.fixed_set import FixedSetServer


Layout = dict[str, tuple[tuple[int, ...], torch.dtype]]


@dataclass
class ReplicaRun:
    """What a parameter-server run's handles share: the layouts replies are checked against, and the
    current order's encoded messages (encoded once, sent to every worker)."""

    parameters: dict[str, Layout]  # model -> its parameters' layout (gradients)
    buffers: dict[str, Layout]  # model -> its buffers' layout ({} for the MLPs)
    encoded: tuple[GradientOrder, list[pb.ServerMessage]] | None = None

    def messages(self, order: GradientOrder) -> list[pb.ServerMessage]:
        if self.encoded is None or self.encoded[0] is not order:
            messages = []
            for model, state in (("generator", order.generator), ("discriminator", order.discriminator)):
                if state is not None:
                    messages += [pb.ServerMessage(replica_part=part) for part in
                                 codec.replica_parts(state, order.iteration, order.round, model, "weights")]
            messages.append(pb.ServerMessage(replica_round=psgan_pb2.ReplicaRound(
                iteration=order.iteration, round=order.round, want_discriminator=order.want_discriminator,
                want_generator=order.want_generator)))
            self.encoded = (order, messages)
        return self.encoded[1]

    def expected_reply(self, order: GradientOrder) -> dict[tuple[str, str], Layout]:
        """(model, content) -> layout of every set the answer to `order` must carry (library's GradientReply)."""
        expected = {}
        if order.want_discriminator:
            expected[("discriminator", "gradients")] = self.parameters["discriminator"]
        if order.want_generator:
            expected[("generator", "gradients")] = self.parameters["generator"]
        if self.buffers["discriminator"]:
            expected[("discriminator", "buffers")] = self.buffers["discriminator"]
        if order.want_generator and self.buffers["generator"]:
            expected[("generator", "buffers")] = self.buffers["generator"]
        return expected


class GrpcReplica(StreamHandle, ReplicaHandle):
    """The parameter-server GAN's ReplicaHandle for a worker on the other end of a stream."""

    algorithm = "psgan"
    # A joiner's replica would start its sampler and noise from scratch mid-run; the trainer's set is fixed.
    late_join_refusal = "a parameter-server run takes no workers once it started"

    def __init__(self, connection: WorkerConnection, run: ReplicaRun, needs_copy: bool = False):
        super().__init__(connection)
        self.run = run
        self._rounds = connection.answers("round")  # (iteration, round) -> Future[GradientReply]
        self._pending: tuple[int, int] | None = None  # the round in flight
        self._returning: dict[tuple[str, str], codec.StateAssembler] = {}
        self._discarding: tuple[int, int] | None = None  # a round already refused: its other parts are dropped

    @classmethod
    def run_state(cls, coordinator) -> ReplicaRun:
        spec = coordinator.config.model
        modules = {"generator": build_generator(spec, 0), "discriminator": build_discriminator(spec, 0)}
        return ReplicaRun({m: codec.layout_of(dict(mod.named_parameters())) for m, mod in modules.items()},
                          {m: codec.layout_of(dict(mod.named_buffers())) for m, mod in modules.items()})

    def receivers(self):
        return {"replica_part": self._on_part, "replica_gradients": self._on_gradients}

    traffic = staticmethod(wire.psgan)  # (kind, payload bytes) of its messages, as both sides count them

    async def round(self, order: GradientOrder) -> GradientReply:
        key = (order.iteration, order.round)
        self._pending, self._discarding = key, None
        self._returning = {k: codec.StateAssembler(layout) for k, layout in self.run.expected_reply(order).items()}
        try:
            return await self.connection.request(self._rounds, key, self.run.messages(order))
        finally:
            self._pending, self._returning = None, {}

    async def _fail_round(self, key: tuple[int, int], reason: str, detail: str) -> None:
        self._discarding = key
        self._returning = {}
        await self.connection.reject(key[0], reason, detail)
        future = self._rounds.get(key)
        if future is not None and not future.done():
            future.set_exception(InputRejected(reason, detail))

    async def _on_part(self, part: psgan_pb2.ReplicaPart) -> None:
        key = (part.iteration, part.round)
        if key == self._discarding:
            return
        if key != self._pending:
            await self.connection.reject(part.iteration, "round",
                                         f"no round {part.round} of iteration {part.iteration} in flight")
            return
        assembler = self._returning.get((part.model, part.content))
        if assembler is None:
            await self._fail_round(key, "protocol", f"round {part.round} of iteration {part.iteration} asked for no "
                                                    f"{part.content[:32]!r} of the {part.model[:32]!r}")
            return
        try:
            assembler.accept(part)
        except codec.InvalidTensor as exc:
            await self._fail_round(key, exc.reason, f"{part.model} {part.content}: {exc}")

    async def _on_gradients(self, done: psgan_pb2.ReplicaGradients) -> None:
        key = (done.iteration, done.round)
        if key == self._discarding:
            return
        future = self._rounds.get(key)
        if future is None or future.done():
            await self.connection.reject(done.iteration, "round",
                                         f"no round {done.round} of iteration {done.iteration} in flight")
            return
        try:
            sets = {k: assembler.finish() for k, assembler in self._returning.items()}
        except codec.InvalidTensor as exc:
            await self._fail_round(key, exc.reason, f"round {done.round} of iteration {done.iteration}: {exc}")
            return
        future.set_result(GradientReply(
            discriminator=sets.get(("discriminator", "gradients")), generator=sets.get(("generator", "gradients")),
            discriminator_buffers=sets.get(("discriminator", "buffers"), {}),
            generator_buffers=sets.get(("generator", "buffers"), {}),
            disc_loss=done.disc_loss, gen_loss=done.gen_loss, real_accuracy=done.real_accuracy,
            fake_accuracy=done.fake_accuracy))


class PSGANServer(FixedSetServer):
    """A parameter-server run on the server: PSGANTrainer over a fixed set of GrpcReplicas."""

    name = "psgan"
    handle = GrpcReplica

    def describe(self, spec: pb.TrainingSpec) -> None:
        """The Welcome's spec records Q (the run's record; only the server uses it)."""
        spec.psgan.threshold = self.options.resolve(self.ctx.config.workers)

    def build_trainer(self, workers: list[GrpcReplica]) -> PSGANTrainer:
        ctx = self.ctx
        return PSGANTrainer(ctx.config, self.options, ParameterServer(ctx.config, ctx.generator), workers,
                                   step_timeout=ctx.args.step_timeout, on_iteration=self.on_iteration)
