"""Workers of one process side by side on one GPU (`mdgan simulate` on CUDA): each worker's step runs on a CUDA
stream of its own, so the small kernels of one worker's batch of b samples run beside the other workers' instead of
one after the other. Nothing a step computes changes: each worker's kernels are the same, in the same order on its
own stream, and nothing is summed across streams.

The order kept: a step starts after the kernels the main stream had queued when the first step on its batches'
generation began (the generated batches, the swaps before them), never after another worker's step of that
generation (--sync async makes batches again inside an iteration: each generation has its own gate); the main stream goes on (the
feedback's aggregation, the stats read) only after the steps whose outputs it uses. Tensors made on a lane and used
on the main stream are marked so that the allocator does not hand their memory out again before the main stream
is done with them.

MDGAN_CUDA_LANES=0 in the environment runs every step on the main stream."""

from __future__ import annotations

import contextlib
import os

import torch

ENVIRONMENT = "MDGAN_CUDA_LANES"


class Lanes:
    """One process's lanes: what orders its workers' steps against the main stream. Inactive (no lanes) on the CPU
    and when turned off."""

    def __init__(self, device: torch.device):
        self.device = device
        self.active = device.type == "cuda" and os.environ.get(ENVIRONMENT, "1") != "0"
        self._key: object = None
        self._ready: torch.cuda.Event | None = None  # recorded on the main stream before the generation's steps

    def lane(self) -> "Lane":
        return Lane(self)

    def _gate(self, key) -> torch.cuda.Event:
        """The event a step on batches of `key` (their iteration and generation) waits for: recorded on the main
        stream by the first such step, after the batches were made."""
        if key != self._key:
            self._key, self._ready = key, torch.cuda.Event()
            self._ready.record(torch.cuda.current_stream(self.device))
        return self._ready


class Lane:
    """One worker's stream."""

    def __init__(self, lanes: Lanes):
        self.lanes = lanes
        self.stream = torch.cuda.Stream(lanes.device) if lanes.active else None

    @contextlib.contextmanager
    def step(self, key, inputs: list[torch.Tensor | None]):
        """Run the block on this lane: it waits for the main stream as the batches' generation (`key`) found it;
        `inputs` (made on the
        main stream) are kept from reuse until the lane is done with them. The block's result goes through
        `handover` before the main stream touches it."""
        if self.stream is None:
            yield
            return
        main = torch.cuda.current_stream(self.lanes.device)
        self.stream.wait_event(self.lanes._gate(key))
        for t in inputs:
            if t is not None and t.is_cuda:
                t.record_stream(self.stream)
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:  # the main stream waits for whatever the lane queued, even when the block raised
            main.wait_stream(self.stream)

    def handover(self, outputs: list) -> None:
        """Tensors the lane made that the main stream uses next (the feedback, the stats): their memory is not
        handed out again before the main stream's work on them is done."""
        if self.stream is None:
            return
        main = torch.cuda.current_stream(self.lanes.device)
        for t in outputs:
            if isinstance(t, torch.Tensor) and t.is_cuda:
                t.record_stream(main)
