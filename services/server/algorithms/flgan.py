"""FL-GAN (FedAvg of whole GANs) on the server: the library's FederatedWorker over a worker's stream,
and the run around mdgan.algorithms.flgan.FederatedTrainer. Speaks model parts and local rounds."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mdgan.algorithms.flgan import FederatedTrainer, FederatedWorker, LocalRoundResult
from mdgan import privacy
from mdgan.algorithms.base import InputRejected
from mdgan.config import PrivacySpec
from services.common import codec
from services.common.proto import coordinator_pb2 as pb
from services.common import wire
from services.server.connection import StreamHandle, WorkerConnection
from services.server.algorithms.fixed_set import FixedSetServer



@dataclass
class FederatedRun:
    """What an FL-GAN run's handles share."""

    model_layouts: dict[str, dict]  # model -> the layout every returning state is checked against
    privacy: PrivacySpec = PrivacySpec()  # what a private site's statistics withhold


class GrpcFederatedWorker(StreamHandle, FederatedWorker):
    """FL-GAN's FederatedWorker for a worker on the other end of a stream."""

    algorithm = "flgan"
    late_join_refusal = "an FL-GAN run takes no workers once it started"

    def __init__(self, connection: WorkerConnection, run: FederatedRun, needs_copy: bool = False):
        super().__init__(connection)
        self.model_layouts = run.model_layouts
        self.privacy = run.privacy
        self._rounds = connection.answers("round")  # round -> Future[LocalRoundResult]
        # the models coming back in the current round, checked against model_layouts
        self._returning: dict[tuple[int, str], codec.StateAssembler] = {}
        self._discarding = -1  # a round already refused: the rest of its parts are dropped quietly

    @classmethod
    def run_state(cls, coordinator) -> FederatedRun:
        return FederatedRun(coordinator.model_layouts or {}, coordinator.config.privacy)

    def receivers(self):
        return {"model_part": self._on_model_part, "local_round_done": self._on_local_round_done}

    traffic = staticmethod(wire.flgan)  # (kind, payload bytes) of its messages, as both sides count them

    async def local_round(self, round_: int, first_iteration: int, iterations: int,
                          generator: dict[str, torch.Tensor], discriminator: dict[str, torch.Tensor]) -> LocalRoundResult:
        self._returning = {(round_, model): codec.StateAssembler(layout) for model, layout in self.model_layouts.items()}
        parts = [pb.ServerMessage(model_part=part) for model, state in (("generator", generator),
                                                                         ("discriminator", discriminator))
                 for part in codec.model_parts(state, round_, model)]
        order = pb.ServerMessage(local_round=pb.LocalRound(round=round_, first_iteration=first_iteration,
                                                           iterations=iterations))
        try:
            return await self.connection.request(self._rounds, round_, [*parts, order])
        finally:
            self._returning = {}

    async def _fail_round(self, round_: int, reason: str, detail: str) -> None:
        self._discarding = round_
        await self.connection.reject(round_, reason, detail)
        future = self._rounds.get(round_)
        if future is not None and not future.done():
            future.set_exception(InputRejected(reason, detail))
        self._returning = {}

    async def _on_model_part(self, part: pb.ModelPart) -> None:
        if part.round == self._discarding:
            return
        assembler = self._returning.get((part.round, part.model))
        if assembler is None:
            await self.connection.reject(part.round, "round", f"no {part.model!r} expected for round {part.round}")
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
            await self.connection.reject(done.round, "round", f"no local round {done.round} pending")
            return
        try:
            states = {model: self._returning[(done.round, model)].finish() for model in wire.MODELS}
        except (codec.InvalidTensor, KeyError) as exc:
            await self._fail_round(done.round, getattr(exc, "reason", "protocol"), f"models of round {done.round}: {exc}")
            return
        # a private site's withheld statistics are absent from its message (read as 0): NaN, as in one process
        stats = [privacy.released_stats({
            "gen_loss": s.gen_loss, "disc_loss": s.disc_loss, "real_accuracy": s.real_accuracy,
            "fake_accuracy": s.fake_accuracy,
            # DP: the budget the site says it spent (delta > 0 only from a private site)
            **({"epsilon": s.epsilon, "delta": s.delta, "fixed_noise": s.fixed_noise} if s.delta > 0 else {})},
            self.privacy) for s in done.stats]
        sent = sum(t.numel() * t.element_size() for state in states.values() for t in state.values())
        future.set_result(LocalRoundResult(states["generator"], states["discriminator"], stats, sent))


class FederatedServer(FixedSetServer):
    """An FL-GAN run on the server: FederatedTrainer over a fixed set of GrpcFederatedWorkers."""

    name = "flgan"
    handle = GrpcFederatedWorker

    def build_trainer(self, workers: list[GrpcFederatedWorker]) -> FederatedTrainer:
        ctx = self.ctx
        return FederatedTrainer(ctx.config, ctx.generator, workers, ctx.initial_discriminator,
                                round_timeout=ctx.args.round_timeout, on_iteration=self.on_iteration,
                                on_round=ctx.recorder.swap)
