"""What the FL-GAN, P-WGAN and parameter-server runs share on the server: they wait for every slot, train
over that fixed set of workers, take no late joiners and no checkpoints, and their workers talk to
the server only."""

from __future__ import annotations

import asyncio

from mdgan.algorithms import durable_names
from mdgan.config import ConfigError
from services.common.settings import algorithm_options
from services.server.context import ServerContext, until


class FixedSetServer:
    """The base of a run class; a subclass sets `name` (its registry name) and `handle`, and writes
    build_trainer(workers). What the algorithm refuses is said by mdgan.algorithms.refuse (main asks it)."""

    stop_requested = False
    name = ""

    @classmethod
    def check(cls, args, run) -> None:
        if args.min_workers is not None:
            raise ConfigError(f"--min-workers works with {durable_names()} only (--algorithm {cls.name} starts with "
                              f"every worker and takes no late joiner)")
        algorithm_options(cls.name, args, run.config)  # its own options, and the run's, checked for it

    def __init__(self, ctx: ServerContext):
        self.ctx = ctx
        self.trainer = None  # built by build_trainer once every slot has a worker
        self.options = algorithm_options(self.name, ctx.args)  # None: the algorithm has none

    def summary_fields(self) -> dict:
        """summary.json's record of the algorithm's options, as `mdgan simulate` writes it."""
        return {} if self.options is None else {self.name: self.options.summary(self.ctx.config)}

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
