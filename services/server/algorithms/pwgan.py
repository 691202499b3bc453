"""The parallel Wasserstein GAN on the server: the library's CriticHandle over a worker's stream, and
the run around mdgan.algorithms.pwgan.PWGANTrainer. Speaks potential rounds (down) and potential
counts (up), protos/mdgan/v1/pwgan.proto."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mdgan.algorithms import pwgan
from mdgan.algorithms.pwgan import COUNT_DTYPE, CriticHandle, CriticResult, PotentialOrder, PWGANTrainer, RoundReply
from mdgan.algorithms.base import InputRejected
from mdgan.config import TrainingConfig
from services.common import codec
from services.common.proto import coordinator_pb2 as pb
from services.common.proto import pwgan_pb2
from services.common import wire
from services.server.connection import StreamHandle, WorkerConnection
from services.server.algorithms.fixed_set import FixedSetServer


@dataclass
class PWGANRun:
    """What a P-WGAN run's handles share: the config, and the message of the round under way,
    encoded once for all K workers (every worker gets the same PotentialOrder)."""

    config: TrainingConfig
    _order: PotentialOrder | None = None
    _message: pb.ServerMessage | None = None

    def message(self, order: PotentialOrder) -> pb.ServerMessage:
        if order is not self._order:
            encode = codec.encode_tensor
            self._order, self._message = order, pb.ServerMessage(potential_round=pwgan_pb2.PotentialRound(
                iteration=order.iteration, round=order.round, potentials=encode(order.potentials),
                generated=None if order.generated is None else encode(order.generated),
                generated_labels=None if order.generated_labels is None else encode(order.generated_labels),
                last=order.last))
        return self._message


class GrpcCritic(StreamHandle, CriticHandle):
    """P-WGAN's CriticHandle for a worker on the other end of a stream."""

    algorithm = "pwgan"
    late_join_refusal = "a P-WGAN run takes no workers once it started"

    def __init__(self, connection: WorkerConnection, run: PWGANRun, needs_copy: bool = False):
        super().__init__(connection)
        self.run = run
        self.config = run.config
        self._rounds = connection.answers("round")  # (iteration, round) -> Future[RoundReply]
        self._asked: dict[tuple[int, int], PotentialOrder] = {}

    @classmethod
    def run_state(cls, coordinator) -> PWGANRun:
        return PWGANRun(coordinator.config)

    def receivers(self):
        return {"potential_counts": self._on_counts}

    traffic = staticmethod(wire.pwgan)  # (kind, payload bytes) of its messages, as both sides count them

    async def round(self, order: PotentialOrder) -> RoundReply:
        key = (order.iteration, order.round)
        self._asked[key] = order
        try:
            return await self.connection.request(self._rounds, key, self.run.message(order))
        finally:
            self._asked.pop(key, None)

    async def _on_counts(self, reply: pwgan_pb2.PotentialCounts) -> None:
        key = (reply.iteration, reply.round)
        future, order = self._rounds.get(key), self._asked.get(key)
        if future is None or future.done() or order is None:
            await self.connection.reject(reply.iteration, "iteration",
                                         f"no potential round {reply.round} of iteration {reply.iteration} pending")
            return
        try:
            decoded = self._decode(reply, order)
        except (codec.InvalidTensor, InputRejected) as exc:
            reason = exc.reason
            detail = exc.detail if isinstance(exc, InputRejected) else str(exc)
            await self.connection.reject(reply.iteration, reason, detail)
            future.set_exception(InputRejected(reason, detail))
            return
        future.set_result(decoded)

    def _decode(self, reply: pwgan_pb2.PotentialCounts, order: PotentialOrder) -> RoundReply:
        """The reply, checked against the order it answers; raises InvalidTensor or InputRejected."""
        config = self.config
        n_g, shape = order.potentials.shape[0], tuple(config.model.sample_shape)
        if not reply.HasField("counts"):
            raise codec.InvalidTensor("missing", "potential counts without counts")
        counts = codec.decode_tensor(reply.counts, shape=(n_g,), dtype=COUNT_DTYPE, field="counts")
        result = None
        if order.last:
            if not reply.HasField("feedback"):
                raise codec.InvalidTensor("missing", f"round {order.round} is the last: its answer needs feedback")
            feedback = codec.decode_tensor(reply.feedback, shape=(n_g, *shape), dtype=torch.float32, field="feedback")
            if not math.isfinite(reply.transport_cost) or not (math.isfinite(reply.disc_loss) or config.disc_steps == 0):
                raise InputRejected("nonfinite", "transport cost and critic loss must be finite")
            result = CriticResult(feedback, reply.transport_cost, reply.disc_loss)
        elif reply.HasField("feedback"):
            raise InputRejected("protocol", f"feedback in round {order.round} of {order.iteration}: only the last "
                                            "round carries it")
        decoded = RoundReply(counts, result)
        pwgan.check_reply(decoded, n_g, config.batch_size, order.last, shape)  # >= 0, summing to n_r
        return decoded


class PWGANServer(FixedSetServer):
    """A P-WGAN run on the server: PWGANTrainer over the GrpcCritics of every slot (it drops the
    workers it loses and goes on with the others)."""

    name = "pwgan"
    handle = GrpcCritic

    def describe(self, spec: pb.TrainingSpec) -> None:
        """The Welcome's spec carries T, eta and lambda to the workers."""
        codec.describe_options(spec, "pwgan", self.options)

    def build_trainer(self, workers: list[GrpcCritic]) -> PWGANTrainer:
        ctx = self.ctx
        return PWGANTrainer(ctx.config, self.options, ctx.generator, workers, step_timeout=ctx.args.step_timeout,
                            on_iteration=self.on_iteration)
