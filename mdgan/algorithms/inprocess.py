"""The in-process worker handle both new algorithms share: a side object in this process that
answers one order per round, and can crash (the paper's crash experiment)."""

from __future__ import annotations

from mdgan.algorithms.base import WorkerLost


class InProcessRounds:
    """Mixed into an algorithm's handle class: `side.handle(order)` answers each round."""

    def __init__(self, side):
        self.side = side
        self.shard_index = side.shard_index
        self.worker_id = f"worker-{side.shard_index}"
        self.shard_size = len(side.sampler.shard)
        self.crashed = False

    def crash(self) -> None:
        """The worker and its data leave the run."""
        self.crashed = True

    async def round(self, order):
        if self.crashed:
            raise WorkerLost(f"{self.worker_id} crashed")
        return self.side.handle(order)

    async def stop(self, reason: str) -> None:
        return None
