"""MD-GAN on a worker: batches and checkpoints (worker.py), swaps and copies (swaps.py), pushes to a
peer, direct or through the relay (push.py)."""

from services.worker.algorithms.mdgan.push import PeerPusher, PushOutcome  # noqa: F401
from services.worker.algorithms.mdgan.swaps import TakeOutcome, WorkerSwaps  # noqa: F401
from services.worker.algorithms.mdgan.worker import MDGANWorker, wire_stats  # noqa: F401
