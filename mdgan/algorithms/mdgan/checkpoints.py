"""MD-GAN's server side of a checkpoint: what it holds, and how it is restored.

A checkpoint of an MD-GAN run is the server's file (this) plus every live worker's (its
DiscriminatorSide.state_dict, written where the worker keeps its state); mdgan/checkpoint.py says how
files are written and which checkpoint is complete. Used by `mdgan simulate` and mdgan-server alike.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

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
