"""MD-GAN's server side of a checkpoint: what it holds, and how it is restored.

A checkpoint of an MD-GAN run is the server's file (this) plus every live worker's (its
DiscriminatorSide.state_dict, written where the worker keeps its state); mdgan/checkpoint.py says how
files are written and which checkpoint is complete. Used by `mdgan simulate` and mdgan-server alike.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import TYPE_CHECKING, Callable

from mdgan.algorithms.base import WorkerLost, ask_all, why_lost
from mdgan.algorithms.mdgan.handle import WorkerHandle
from mdgan.checkpoint import CheckpointStore
from mdgan.gan import GeneratorSide

if TYPE_CHECKING:
    from mdgan.algorithms.mdgan.trainer import Trainer
    from mdgan.run import RunRecorder

log = logging.getLogger(__name__)


class ServerCheckpoints:
    """The server's part of each checkpoint: G, Adam, RNGs, the loop's counters and membership,
    the evaluator's schedule (history position = the iteration), in OUT/checkpoints."""

    def __init__(self, out_dir: str, run_id: str, keep: int = 3):
        self.store = CheckpointStore(os.path.join(out_dir, "checkpoints"), keep)
        self.run_id = run_id

    def save(self, iteration: int, wrote_all: bool, generator_side: GeneratorSide, trainer: Trainer,
             recorder: "RunRecorder") -> None:
        state = {"run_id": self.run_id, "iteration": iteration, "generator_side": generator_side.state_dict(),
                 "trainer": trainer.state_dict(), "recorder": recorder.state_dict()}
        self.store.save(iteration, "server", state)
        if wrote_all:  # seconds: what this checkpoint cost the run, workers' writes included
            self.store.mark_complete(iteration, {"run_id": self.run_id,
                                                 "workers": [w.worker_id for w in trainer.roster.members()],
                                                 "seconds": time.perf_counter() - trainer.checkpoint_started})
            log.info("checkpoint %d complete", iteration)
        else:
            log.warning("checkpoint %d incomplete: not every live worker saved its state (or none was left)", iteration)

    @staticmethod
    def restore(state: dict, generator_side: GeneratorSide, trainer: Trainer, recorder: "RunRecorder") -> None:
        generator_side.load_state_dict(state["generator_side"])
        trainer.load_state_dict(state["trainer"])
        recorder.load_state_dict(state["recorder"])


class BoundaryCheckpoints:
    """Checkpoints at iteration boundaries: every member saves its state and the server its own
    (`save(iteration, wrote_all)`), every `every` iterations, at a stop, and at the run's end."""

    def __init__(self, membership, every: int = 0, timeout: float | None = None,
                 save: Callable[[int, bool], None] | None = None):
        self.membership = membership
        self.every = every
        self.timeout = timeout
        self.save = save
        self.last = 0  # the boundary of the last checkpoint taken
        self.started = 0.0  # perf_counter() when the checkpoint under way began

    async def checkpoint(self, t: int) -> bool:
        """Every member saves its state for boundary t, and the server its own (save_checkpoint);
        True when all of them wrote theirs (the checkpoint is complete)."""
        self.started = time.perf_counter()
        members = self.membership.roster.members()

        async def save(worker: WorkerHandle) -> str | None:  # None: saved; else why not (a failed write too)
            try:
                return await worker.checkpoint(t)
            except (WorkerLost, asyncio.TimeoutError):
                raise
            except Exception as exc:
                return repr(exc)

        replies = await ask_all(members, save, self.timeout)
        # A worker lost during it, or none left at all (as when a SIGTERM reaches the whole cluster at
        # once): not complete. Resumed, it gave every worker a fresh discriminator ("a copy" of nobody's);
        # the checkpoint before has them all.
        wrote_all = bool(members) and not replies.lost and all(why is None for why in replies.answers)
        for worker, error in replies.lost:  # its discriminator is in no state of this checkpoint
            await self.membership.drop(worker, why_lost(error, "missed its checkpoint deadline"))
        for worker, why in replies.good:
            if why is not None:
                log.warning("checkpoint %d: %s did not save its state: %s", t, worker.worker_id, why)
        if self.save is not None:
            self.save(t, wrote_all)
        self.last = t
        return wrote_all

    def save_final(self, t: int) -> None:
        """The run's end on disk before any worker hears of it. Told the run is finished, a worker
        forgets it and leaves; a server killed after telling them, before writing its outputs, resumes
        from here (`finished`) with nothing left to train, instead of waiting for workers that are gone.
        The workers need not save: nothing will ever train their discriminators again."""
        if not (self.every and self.save is not None) or self.last == t:
            return
        self.started = time.perf_counter()
        self.save(t, True)
        self.last = t
