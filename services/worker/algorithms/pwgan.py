"""The parallel Wasserstein GAN on a worker: a critic D_k on the local shard (the library's CriticSide).
Takes potential rounds (round 1 with the generated batch), answers each with its Voronoi counts, and
the last round also with its feedback F_k (protos/mdgan/v1/pwgan.proto)."""

from __future__ import annotations

import logging
import time

import torch

from mdgan.algorithms.pwgan import CriticSide, PotentialOrder
from mdgan.config import ConfigError, TrainingConfig
from mdgan.data import Shard
from services.common import codec
from services.common.proto import coordinator_pb2 as pb
from services.common.proto import pwgan_pb2
from services.common import wire
from services.worker.algorithms.base import ServerGone, WorkerAlgorithm

log = logging.getLogger("mdgan.worker")


class PWGANWorker(WorkerAlgorithm):
    name = "pwgan"

    def __init__(self, node, config: TrainingConfig, shard: Shard):
        super().__init__(node, config, shard)
        self.side: CriticSide | None = None  # built at the welcome, whose spec carries T, eta, lambda
        self._started: float | None = None  # when round 1 of the iteration under way arrived

    async def welcome(self, welcome: pb.Welcome) -> None:
        try:
            options = codec.options_from_spec(welcome.spec, "pwgan")
        except ConfigError as exc:
            raise ServerGone(f"the server's P-WGAN options are invalid: {exc}") from exc
        self.side = CriticSide(self.config, self.shard, options)
        log.info("P-WGAN critic: T=%d potential rounds, eta=%g, gradient penalty %g", options.potential_rounds,
                 options.potential_lr, options.gradient_penalty)

    def receivers(self):
        return {"potential_round": self._on_round}

    traffic = staticmethod(wire.pwgan)  # (kind, payload bytes) of its messages, as both sides count them

    def _decode(self, message: pwgan_pb2.PotentialRound) -> PotentialOrder:
        """The server's order, checked like anyone's input; raises InvalidTensor."""
        config = self.config
        b, shape = config.batch_size, (config.batch_size, *config.model.sample_shape)
        if not message.HasField("potentials"):
            raise codec.InvalidTensor("missing", "a potential round without potentials")
        potentials = codec.decode_tensor(message.potentials, shape=(b,), dtype=torch.float32, field="potentials")
        generated = labels = None
        if message.HasField("generated"):
            generated = codec.decode_tensor(message.generated, shape=shape, dtype=torch.float32, field="generated")
            if config.model.conditional:
                if not message.HasField("generated_labels"):
                    raise codec.InvalidTensor("missing", "an ACGAN batch without its labels")
                labels = codec.decode_labels(message.generated_labels, b, config.model.num_classes,
                                             "generated_labels")
        return PotentialOrder(message.iteration, message.round, potentials, generated, labels, message.last)

    async def _on_round(self, call, message: pwgan_pb2.PotentialRound) -> None:
        if self.side is None:
            raise ServerGone("a potential round before the welcome")
        try:
            order = self._decode(message)
            if order.round == 1:
                self._started = time.perf_counter()
            # On the event loop's thread, as MD-GAN's step: the rounds take milliseconds.
            reply = self.side.handle(order)  # raises ValueError on an order out of protocol
        except ValueError as exc:  # InvalidTensor is one
            raise ServerGone(f"the server sent an invalid potential round: {exc}") from exc
        answer = pwgan_pb2.PotentialCounts(iteration=order.iteration, round=order.round,
                                           counts=codec.encode_tensor(reply.counts))
        result = reply.result
        if result is not None:
            answer.feedback.CopyFrom(codec.encode_tensor(result.feedback))
            answer.transport_cost, answer.disc_loss = result.transport_cost, result.disc_loss
        await self.node.write(call, pb.WorkerMessage(potential_counts=answer))
        if result is not None:
            self.trained_iteration = order.iteration
            t = self.node.telemetry
            t.iterations.inc()
            if self._started is not None:
                t.iteration_seconds.observe(time.perf_counter() - self._started)
            t.phase_seconds.labels("disc_steps").observe(result.disc_seconds)
            t.phase_seconds.labels("feedback").observe(result.feedback_seconds)
            t.generator_loss.set(result.transport_cost)
            t.discriminator_loss.set(result.disc_loss)
            t.last_iteration.set_to_current_time()
