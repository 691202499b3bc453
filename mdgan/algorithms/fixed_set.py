"""What the P-WGAN and parameter-server training loops share: the workers present at the start, in rank
order, each dropped for good when it is lost or misses its deadline; I iterations, or fewer when too
few workers are left. (MD-GAN's loop, mdgan/algorithms/mdgan/trainer.py, admits workers at any boundary instead.)"""

from __future__ import annotations

import logging
from typing import Callable

from mdgan.algorithms.base import (RUN_FINISHED, IterationRecord, Replies, RunResult, Traffic, ask_all,
                                   last_iteration, tell_to_stop, why_lost)
from mdgan.config import TrainingConfig

log = logging.getLogger(__name__)


class FixedSetTrainer:
    """The base of a loop over a fixed set of worker handles; a subclass writes iteration(t)."""

    def __init__(self, config: TrainingConfig, workers: list, *, step_timeout: float | None = None,
                 on_iteration: Callable[[IterationRecord], None] | None = None, stop_after: int | None = None):
        self.config = config
        self.until = last_iteration(config, stop_after)
        self.workers = sorted(workers, key=lambda w: w.shard_index)  # rank order: sums are repeatable
        self.active = list(self.workers)
        self.step_timeout = step_timeout
        self.on_iteration = on_iteration
        self.traffic = Traffic()
        self.rejections = 0

    async def _drop(self, worker, why: str) -> None:
        if worker in self.active:
            log.warning("dropping %s: %s", worker.worker_id, why)
            self.active.remove(worker)
            await tell_to_stop(worker, why)

    async def ask(self, t: int, r: int, participants: list, order, check: Callable[[object], None]) -> Replies:
        """Send round r's order to every participant at once; the replies that passed `check`, in rank order,
        and those rejected and lost (the workers lost are dropped for good). A rejected worker sits out the
        rest of the iteration (the caller goes on with the workers that answered)."""
        replies = await ask_all(participants, lambda w: w.round(order), self.step_timeout, check)
        for worker, why in replies.rejected:
            log.warning("iteration %d round %d: %s rejected (%s)", t, r, worker.worker_id, why)
        for worker, error in replies.lost:
            await self._drop(worker, why_lost(error))
        return replies

    def too_few_left(self, t: int) -> str | None:
        """Why the run cannot go on to iteration t; None: it can."""
        return None if self.active else f"no workers left after iteration {t - 1}"

    async def iteration(self, t: int) -> IterationRecord:
        raise NotImplementedError

    async def run(self) -> RunResult:
        last, stopped = None, None
        for t in range(1, self.until + 1):
            stopped = self.too_few_left(t)
            if stopped:
                log.error(stopped)
                break
            last = await self.iteration(t)
            if self.on_iteration is not None:
                self.on_iteration(last)
        for worker in list(self.active):
            await tell_to_stop(worker, RUN_FINISHED, 10.0)
        return RunResult(iterations=last.iteration if last else 0, workers=len(self.workers),
                         workers_alive=len(self.active), swaps=0, rejections=self.rejections, swap_period=0,
                         traffic=self.traffic, last=last, stopped_early=stopped)
