"""What the MD-GAN loop knows of a worker: an abstract handle (a DiscriminatorSide in this process,
inprocess.py, or a gRPC stream, services/server/algorithms/mdgan.py), and the swap orders and reports
it exchanges with one."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Awaitable

from mdgan.gan import WorkerBatch
from mdgan.step_results import StepResult

SWAP, COPY = "swap", "copy"


@dataclass(frozen=True)
class SwapOrder:
    """A swap (send yours to send_to, take receive_from's), or a one-way copy to a late joiner
    (kind COPY: the donor has only send_to, the joiner only receive_from; round = the boundary's
    iteration, or above it for a copy tried again: each attempt has a number of its own)."""

    swap_round: int
    send_to: str  # worker id that receives this worker's discriminator ("" : send nothing)
    receive_from: str  # worker id whose discriminator this worker takes ("" : take nothing)
    kind: str = SWAP


@dataclass(frozen=True)
class SwapReport:
    swap_round: int
    sent: bool
    received: bool
    sent_bytes: int  # payload: tensor bytes of the discriminator state sent to the peer
    error: str = ""
    refused: str = ""  # the receiver's check refused the incoming D (swapcheck.py): why; it kept its own
    relayed_bytes: int = 0  # sealed bytes its push sent through a relay (services/server/relay.py); 0: direct


class WorkerHandle(abc.ABC):
    """What the training loop sees of a worker, wherever it runs."""

    worker_id: str
    shard_index: int  # fixes the worker's rank order
    shard_size: int  # m

    @abc.abstractmethod
    async def step(self, iteration: int, batch: WorkerBatch) -> StepResult:
        """Send (X_g, X_d), get F_n back. Raises WorkerLost or InputRejected."""

    async def send_step(self, iteration: int, batch: WorkerBatch) -> Awaitable[StepResult]:
        """Send (X_g, X_d) now and return F_n to come (--pipeline-depth: several in flight). What is sent
        to this worker afterwards is handled after this step. Raises WorkerLost (the answer may raise
        WorkerLost or InputRejected)."""
        raise NotImplementedError(f"{type(self).__name__} does not pipeline its steps")

    @abc.abstractmethod
    async def swap(self, order: SwapOrder) -> SwapReport:
        """Send this worker's D to order.send_to and install the one from order.receive_from."""

    async def send_swap(self, order: SwapOrder) -> None:
        """A background swap (--swap-lag > 0), first half: snapshot this worker's D now and send it to
        order.send_to while training goes on; returns at once. Raises WorkerLost."""
        raise NotImplementedError(f"{type(self).__name__} does not swap in the background")

    async def install_swap(self, order: SwapOrder) -> SwapReport:
        """Its second half, `lag` iterations later: install the D from order.receive_from (waiting for it
        if it has not arrived, within the swap deadline) and report the round, as swap() does."""
        raise NotImplementedError(f"{type(self).__name__} does not swap in the background")

    @abc.abstractmethod
    async def cancel_swap(self, swap_round: int, sender: str, reason: str, kind: str = SWAP) -> None:
        """`sender` left during the swap round (or the copy, kind COPY): stop waiting for its discriminator."""

    async def cancel_push(self, swap_round: int, receiver: str, reason: str) -> None:
        """`receiver`, to whom this worker pushes its discriminator in the swap round, left: stop pushing
        (a push retries an unreachable peer until the swap deadline). In one process a push never waits."""

    @abc.abstractmethod
    async def stop(self, reason: str) -> None:
        """The run is over (or this worker is dropped from it)."""

    # A late joiner without usable state of its own waits for a copy of a live peer's D (set by the
    # transport from the roster's RejoinPlan when it admits the worker).
    needs_copy: bool = False

    async def checkpoint(self, iteration: int) -> str | None:
        """Save D, its Adam state and the sampler's state for `iteration` where this worker keeps its
        state; None when written, else why not. Raises WorkerLost."""
        return "this worker keeps no state"
