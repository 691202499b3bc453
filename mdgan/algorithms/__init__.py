"""Other ways to train one GAN over many workers, on MD-GAN's models, data, seeds and outputs.

- ``pwgan``: the parallel Wasserstein GAN (parallel-wgan.txt, Algorithms 1 and 2).
- ``dpgan``: the synchronous data-parallel (parameter-server) GAN (Figure 1a of the same paper,
  coordinator-architecture.txt).

Each module holds both sides of its algorithm (a master side and a worker side), the training loop
over an abstract worker handle, an in-process handle, and its per-iteration traffic formula.
Nothing here knows how the two sides talk (docs/ALGORITHMS.md says what a transport needs).
"""
