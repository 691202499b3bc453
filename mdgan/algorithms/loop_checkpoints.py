"""Checkpoints of an algorithm whose whole loop runs in one process (the standalone GAN and FL-GAN in `mdgan
simulate` and experiments): the loop's whole state in one file a checkpoint (OUT/checkpoints/ITERATION/server.pt,
where MD-GAN's server writes its part; mdgan/checkpoint.py), taken every `every` iterations at the first boundary
the loop can resume from, and the state a resumed run starts from. A run resumed from one goes on bit for bit as
the run that was not stopped (with DP, a site's noise and spending come from its ledger, which never winds back)."""

from __future__ import annotations

import os
import time
from typing import Callable

from mdgan.algorithms.base import InProcessRun
from mdgan.checkpoint import CheckpointStore


class LoopCheckpoints:
    def __init__(self, run: InProcessRun, algorithm: str):
        self.algorithm = algorithm  # (saved: a run is resumed by the algorithm that saved it; mdgan/simulation.py)
        self.every = run.checkpoint_every
        self.run_id = run.run.run_id
        self.recorder = run.recorder
        self.store = CheckpointStore(os.path.join(run.out_dir, "checkpoints"), run.keep_checkpoints)
        self._resumed = run.run.state  # the saved state of the checkpoint the run resumes from; None: from 0
        self._due = False

    def restore(self) -> dict | None:
        """The loop's state to start from (its recorder's schedule restored already), or None: from iteration 0."""
        if self._resumed is None:
            return None
        self.recorder.load_state_dict(self._resumed["recorder"])
        return self._resumed

    def after(self, before: int, t: int, until: int, state: Callable[[], dict]) -> None:
        """The loop went from iteration `before` to boundary t, one it can resume from: the checkpoint due since the
        last one (a multiple of every passed), unless the run ends here (its outputs are written next)."""
        if self.every and t // self.every > before // self.every:
            self._due = True
        if self._due and t < until:
            self._due = False
            started = time.perf_counter()
            self.store.save(t, "server", {"run_id": self.run_id, "iteration": t, "algorithm": self.algorithm,
                                          "recorder": self.recorder.state_dict(), **state()})
            self.store.mark_complete(t, {"run_id": self.run_id, "workers": [],
                                         "seconds": time.perf_counter() - started})


def loop_checkpoints(run: InProcessRun, algorithm: str) -> LoopCheckpoints | None:
    """The run's checkpoints when it takes any or resumes from one; None otherwise."""
    return LoopCheckpoints(run, algorithm) if run.checkpoint_every or run.run.state is not None else None
