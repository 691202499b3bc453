"""An experiment's time limit (`mdgan experiment --time-limit SECONDS`): which of its runs to start so that they
end in time (mdgan_app/experiment.py stops those still under way when the time is up: each trains in a process of
its own, ended from outside).

A run is started only when its expected time (its pace here, probed, times the iterations it has left) ends
before the limit on one of `jobs` lanes, the runs taken shortest first: on a machine held for minutes (a GPU
loan) the runs that can finish do, and a run that could not is left whole for a later start instead of being
cut off. As the dry run, it counts on the device serving `jobs` runs at once as fast as one; what it serves
slower is stopped at the limit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Expected:
    """How long one run is expected to take here."""

    name: str
    seconds_per_iteration: float  # its pace here, probed
    iterations_left: int  # its iterations, less those of the checkpoint it resumes from

    @property
    def seconds(self) -> float:
        return self.seconds_per_iteration * self.iterations_left


@dataclass(frozen=True)
class TimePlan:
    """What a time limit lets start, and what it leaves for later (each shortest first)."""

    start: list[Expected]
    later: list[Expected]  # would end after the limit on every lane


def plan(expected: list[Expected], seconds_left: float, jobs: int) -> TimePlan:
    """The runs to start: shortest first, each on the lane that frees first, while it ends within seconds_left."""
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, not {jobs}")
    lanes = [0.0] * jobs
    start, later = [], []
    for run in sorted(expected, key=lambda e: (e.seconds, e.name)):
        lane = lanes.index(min(lanes))
        if lanes[lane] + run.seconds <= seconds_left:
            lanes[lane] += run.seconds
            start.append(run)
        else:
            later.append(run)
    return TimePlan(start, later)


class Deadline:
    """A time limit counted from its making (monotonic clock)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.started = time.monotonic()

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.started)
