"""The parameter-server GAN on a worker: replicas of G and D and the local shard
(mdgan.algorithms.psgan.ReplicaSide). Takes the round's weights (replica parts) and a replica round
order, sends back the gradients asked for, and the replicas' buffers when the models have any."""

from __future__ import annotations

import asyncio
import time

from mdgan.algorithms.psgan import GradientOrder, ReplicaSide
from mdgan.config import TrainingConfig
from mdgan.data import Shard
from services.common import codec
from services.common.proto import coordinator_pb2 as pb
from services.common.proto import psgan_pb2
from services.common import wire
from services.worker.algorithms.base import ServerGone, WorkerAlgorithm



class PSGANWorker(WorkerAlgorithm):
    name = "psgan"

    def __init__(self, node, config: TrainingConfig, shard: Shard):
        super().__init__(node, config, shard)
        self.side = ReplicaSide(config, shard)
        self.layouts = {"generator": codec.layout_of(self.side.generator.state_dict()),
                        "discriminator": codec.layout_of(self.side.discriminator.state_dict())}
        self._round: tuple[int, int] | None = None  # the round whose weights are coming in
        self._incoming: dict[str, codec.StateAssembler] = {}  # model -> its weights

    def receivers(self):
        return {"replica_part": self._on_part, "replica_round": self._on_round}

    traffic = staticmethod(wire.psgan)  # (kind, payload bytes) of its messages, as both sides count them

    async def _on_part(self, call, part: psgan_pb2.ReplicaPart) -> None:
        if part.model not in wire.MODELS or part.content != "weights":
            raise ServerGone(f"the server sent {part.content[:32]!r} of {part.model[:32]!r}; a replica takes the "
                             "models' weights only")
        key = (part.iteration, part.round)
        if key != self._round:  # the first part of a round: whatever came before it is stale
            self._round, self._incoming = key, {}
        if part.model not in self._incoming:
            self._incoming[part.model] = codec.StateAssembler(self.layouts[part.model])
        try:
            self._incoming[part.model].accept(part)
        except codec.InvalidTensor as exc:
            raise ServerGone(f"the server sent an invalid {part.model}: {exc}") from exc

    async def _on_round(self, call, order: psgan_pb2.ReplicaRound) -> None:
        key = (order.iteration, order.round)
        try:
            if key != self._round:
                raise codec.InvalidTensor("protocol", "no weights came for it")
            states = {model: assembler.finish() for model, assembler in self._incoming.items()}
        except codec.InvalidTensor as exc:
            raise ServerGone(f"round {order.round} of iteration {order.iteration}: {exc}") from exc
        finally:
            self._round, self._incoming = None, {}
        started = time.perf_counter()
        try:  # ReplicaSide checks the protocol: round 1 brings G, later rounds follow it
            reply = await asyncio.to_thread(self.side.handle, GradientOrder(
                order.iteration, order.round, states.get("discriminator"), states.get("generator"),
                want_discriminator=order.want_discriminator, want_generator=order.want_generator))
        except ValueError as exc:
            raise ServerGone(f"round {order.round} of iteration {order.iteration}: {exc}") from exc
        write = self.node.write
        for model, content, state in (("discriminator", "gradients", reply.discriminator),
                                      ("generator", "gradients", reply.generator),
                                      ("discriminator", "buffers", reply.discriminator_buffers),
                                      ("generator", "buffers", reply.generator_buffers)):
            if state:  # None: not asked; {}: a model without buffers (the server expects none then)
                for part in codec.replica_parts(state, order.iteration, order.round, model, content):
                    await write(call, pb.WorkerMessage(replica_part=part))
        await write(call, pb.WorkerMessage(replica_gradients=psgan_pb2.ReplicaGradients(
            iteration=order.iteration, round=order.round, disc_loss=reply.disc_loss, gen_loss=reply.gen_loss,
            real_accuracy=reply.real_accuracy, fake_accuracy=reply.fake_accuracy)))
        t = self.node.telemetry
        t.phase_seconds.labels("disc_steps").observe(time.perf_counter() - started)
        if order.want_generator:  # the iteration's last round
            self.trained_iteration = order.iteration
            t.iterations.inc()
            t.generator_loss.set(reply.gen_loss)
            t.discriminator_loss.set(reply.disc_loss)
            t.last_iteration.set_to_current_time()
