"""The parameter-server GAN's room under its former name, kept for a release: code that imports
mdgan.algorithms.dpgan gets mdgan.algorithms.psgan (mdgan/renames.py says the rest)."""

from mdgan.algorithms.psgan import *  # noqa: F401,F403
from mdgan.algorithms.psgan import PSGANOptions as DPGANOptions  # noqa: F401  (its former name)
from mdgan.algorithms.psgan import PSGANTrainer as DataParallelTrainer  # noqa: F401
