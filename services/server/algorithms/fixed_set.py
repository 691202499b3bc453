"""What the FL-GAN, P-WGAN and data-parallel runs share on the server: they wait for every slot, train
over that fixed set of workers, take no late joiners and no checkpoints, and their workers talk to
the server only."""

from __future__ import annotations

import asyncio

from mdgan.config import ConfigError
from services.server.context import ServerContext, until


class FixedSetServer:
    """The base of a run class; a subclass sets `handle` and writes build_trainer(workers)."""

    stop_requested = False

    @staticmethod
    def check_common(args, run) -> None:
        if args.checkpoint_every or run.state is not None:
            raise ConfigError("checkpoints and resume work with --algorithm mdgan only")

    def __init__(self, ctx: ServerContext):
        self.ctx = ctx
        self.trainer = None  # built by build_trainer once every slot has a worker

    def build_trainer(self, workers: list):
        """The library's training loop over these handles; it has `active` and `run()`."""
        raise NotImplementedError

    def swap_round(self) -> int:
        return 0

    def on_iteration(self, record) -> None:
        self.ctx.on_iteration(record, len(self.trainer.active))

    async def run(self, coordinator, stopping: asyncio.Event):
        """(RunResult, wall seconds) once the iterations are done, or too few workers are left."""
        ctx = self.ctx
        workers = await until(coordinator.wait_for_workers(ctx.args.join_timeout), stopping)
        ctx.recorder.started = ctx.clock()
        self.trainer = self.build_trainer(workers)
        result = None
        try:
            result = await until(self.trainer.run(), stopping)
        finally:
            wall = ctx.recorder.close(result.iterations if result else None)
        return result, wall

    @staticmethod
    def worker_to_worker_bytes(coordinator) -> int:
        return 0  # workers talk to the server only
