"""MD-GAN on a worker: batches and checkpoints (worker.py), swaps and copies (swaps.py), pushes to a
peer, direct or through the relay (push.py)."""

from services.worker.algorithms.mdgan.worker import MDGANWorker  # noqa: F401  (the registry's entry)
