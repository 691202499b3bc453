"""FL-GAN (FedAvg of whole GANs) on a worker: a whole GAN on the local shard. Takes the global models
(model parts) and a local round order, trains, sends both models back."""

from __future__ import annotations

import asyncio
import time

from mdgan import privacy
from mdgan.algorithms.standalone import LocalGAN
from mdgan.algorithms.flgan import make_flgan_worker_gan, train_local_round
from mdgan.config import TrainingConfig
from mdgan.data import Shard
from services.common import codec
from services.common.proto import coordinator_pb2 as pb
from services.common import wire
from services.worker.algorithms.base import BudgetSpent, ServerGone, WorkerAlgorithm



class FLGANWorker(WorkerAlgorithm):
    name = "flgan"

    def __init__(self, node, config: TrainingConfig, shard: Shard):
        super().__init__(node, config, shard)
        self.gan: LocalGAN = make_flgan_worker_gan(config, shard, node.run_state.privacy_ledger(config))
        self._incoming: dict[tuple[int, str], codec.StateAssembler] = {}

    def final_discriminator(self) -> dict:
        return self.gan.d.discriminator.state_dict()  # the local D it sent to be averaged at the last round

    def receivers(self):
        return {"model_part": self._on_model_part, "local_round": self._on_local_round}

    traffic = staticmethod(wire.flgan)  # (kind, payload bytes) of its messages, as both sides count them

    async def _on_model_part(self, call, part: pb.ModelPart) -> None:
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
            states = {m: self._incoming.pop((order.round, m)).finish() for m in wire.MODELS}
        except (KeyError, codec.InvalidTensor) as exc:
            raise ServerGone(f"round {order.round} came without valid models: {exc!r}") from exc
        self._incoming.clear()
        private = self.gan.d.private
        refusal = privacy.over_budget(private, self.node.policy.dp_max_epsilon,
                                      order.iterations * self.gan.config.disc_steps) if private is not None else None
        if refusal is not None:  # leave rather than spend past this site's budget
            raise BudgetSpent(f"round {order.round}: {refusal}")
        started = time.perf_counter()
        result = await asyncio.to_thread(train_local_round, self.gan, states["generator"], states["discriminator"],
                                         order.iterations)
        write = self.node.write
        for model, state in (("generator", result.generator), ("discriminator", result.discriminator)):
            for part in codec.model_parts(state, order.round, model):
                await write(call, pb.WorkerMessage(model_part=part))
        await write(call, pb.WorkerMessage(local_round_done=pb.LocalRoundDone(
            round=order.round, stats=[pb.StepStats(**{k: v for k, v in s.items() if v == v}) for s in result.stats])))
        t = self.node.telemetry
        t.iterations.inc(order.iterations)
        t.iteration_seconds.observe((time.perf_counter() - started) / max(1, order.iterations))
        if result.stats:
            t.generator_loss.set(result.stats[-1]["gen_loss"])
            t.discriminator_loss.set(result.stats[-1]["disc_loss"])
            if "epsilon" in result.stats[-1]:
                t.privacy_epsilon.set(result.stats[-1]["epsilon"])
        t.last_iteration.set_to_current_time()
