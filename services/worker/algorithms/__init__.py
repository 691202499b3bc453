"""One module per algorithm on the worker side; adding one = a module and a line here.

Each entry is a WorkerAlgorithm (services/worker/algorithms/base.py), picked by the welcome's
spec.algorithm (see docs/ALGORITHMS.md, "How to add an algorithm")."""

from __future__ import annotations

from services.worker.algorithms.base import WorkerAlgorithm
from services.worker.algorithms.psgan import PSGANWorker
from services.worker.algorithms.flgan import FLGANWorker
from services.worker.algorithms.mdgan import MDGANWorker
from services.worker.algorithms.pwgan import PWGANWorker

ALGORITHMS: dict[str, type[WorkerAlgorithm]] = {
    "mdgan": MDGANWorker,
    "flgan": FLGANWorker,
    "pwgan": PWGANWorker,
    "psgan": PSGANWorker,
}
