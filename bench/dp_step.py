"""One site's DP-SGD step, timed in this process (MNIST shard 0 of 10, MLP ACGAN, b = 10, sigma 1, one thread):
milliseconds a step over 40 steps after 5, and what drawing the step's noise costs (its Gaussians from the site's
ChaCha20 stream against torch.normal's for as many).

    python bench/dp_step.py                  # this checkout
    python bench/dp_step.py --repo OLD_TREE  # another checkout (its step only)

Run it on a quiet machine."""

from __future__ import annotations

import argparse
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", default=REPO)
    parser.add_argument("--data-root", default=os.environ.get("MDGAN_DATA_ROOT", os.path.join(REPO, "..", "shared",
                                                                                             "data")))
    args = parser.parse_args()
    sys.path.insert(0, os.path.abspath(args.repo))
    import torch

    from mdgan.config import DataConfig, PrivacySpec, TrainingConfig
    from mdgan.data import load_shard
    from mdgan.gan import DiscriminatorSide, GeneratorSide

    torch.set_num_threads(1)
    config = TrainingConfig(workers=10, batch_size=10, iterations=1000, seed=0,
                            privacy=PrivacySpec(noise_multiplier=1.0)).validate()
    side = DiscriminatorSide(config, load_shard(DataConfig("mnist", data_root=args.data_root, num_shards=10), 0))
    server = GeneratorSide(config)
    batches = [server.generate(1).for_worker(0) for _ in range(5)]
    for batch in batches:
        side.step(batch)
    started = time.perf_counter()
    for i in range(40):
        side.step(batches[i % 5])
    print(f"{os.path.abspath(args.repo)}: {(time.perf_counter() - started) / 40 * 1000:.1f} ms a DP-SGD site step")
    size = sum(p.numel() for p in side.discriminator.parameters())
    stream = getattr(side.private, "noise", None)
    if hasattr(stream, "normal"):
        started = time.perf_counter()
        for i in range(20):
            stream.normal(10_000 + i, size)
        secret = (time.perf_counter() - started) / 20 * 1000
        started = time.perf_counter()
        for _ in range(20):
            torch.normal(0.0, 1.0, size=(size,))
        print(f"its noise, {size:,} Gaussians: {secret:.1f} ms from ChaCha20, "
              f"{(time.perf_counter() - started) / 20 * 1000:.1f} ms by torch.normal")


if __name__ == "__main__":
    main()
