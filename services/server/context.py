"""What mdgan-server's main hands to the algorithm it runs (services/server/algorithms/)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable

from mdgan.config import TrainingConfig
from mdgan.gan import GeneratorSide
from mdgan.roster import Roster
from mdgan.run import RunRecorder
from mdgan.algorithms.mdgan.checkpoints import ServerCheckpoints
from services.common.telemetry import Telemetry

log = logging.getLogger("mdgan.server")


@dataclass
class ServerContext:
    args: object  # the parsed command line (timeouts, --checkpoint-every, ...)
    config: TrainingConfig
    run: object  # mdgan.run.open_run's answer: run id, resumed state
    telemetry: Telemetry
    generator: GeneratorSide
    initial_discriminator: dict  # D's initial state (FL-GAN starts every worker from it)
    roster: Roster
    recorder: RunRecorder
    saver: ServerCheckpoints
    on_iteration: Callable[[object, int], None]  # (IterationRecord, workers alive): history and meters
    clock: Callable[[], float] = time.perf_counter


async def until(work, stopping: asyncio.Event, ask_to_stop=None, grace: float = 0.0):
    """Run `work`, or give up when a termination signal arrives. With ask_to_stop, the signal first
    asks the work to end by itself (the trainer checkpoints at the next boundary), for up to `grace` s."""
    task = asyncio.ensure_future(work)
    stop = asyncio.ensure_future(stopping.wait())
    done, _ = await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        stop.cancel()
        return task.result()
    if ask_to_stop is not None:
        ask_to_stop()
        done, _ = await asyncio.wait({task}, timeout=grace)
        if task in done:
            return task.result()
        log.warning("the iteration under way did not end within %.0f s: stopping without a checkpoint", grace)
    task.cancel()
    raise SystemExit("terminated by signal")
