"""Playing the server against a site's private feedback: take the noise the run's seed gives off what the site
sent, and look at the rows that are left. While the noise followed the seed, they were the site's clipped rows,
each of norm C exactly; with each site's secret (mdgan/secret_noise.py) they are rows of norm about 4 C.

    python bench/seed_noise_attack.py                  # this checkout
    python bench/seed_noise_attack.py --repo OLD_TREE  # another checkout (git worktree add OLD_TREE 691b267)

One site (shard 0 of two of the synthetic data), b = 8, sigma 1, C 0.1, seed 3; prints for each of the first
answers the norms of three rows as sent (times b) and of all eight rows with the seed's noise taken off.
"""

from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", default=REPO, help="the checkout whose site answers (default: this one)")
    parser.add_argument("--answers", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, os.path.abspath(args.repo))
    import torch

    from mdgan.algorithms.mdgan.private_feedback import PrivateFeedbackSide
    from mdgan.config import DataConfig, PrivacySpec, TrainingConfig
    from mdgan.data import load_shard
    from mdgan.gan import GeneratorSide, derive_seed

    c, b = 0.1, 8
    config = TrainingConfig(workers=2, batch_size=b, iterations=30, seed=3, privacy=PrivacySpec(
        noise_multiplier=1.0, max_grad_norm=c, mechanism="feedback")).validate()
    side = PrivateFeedbackSide(config, load_shard(DataConfig("synthetic", num_shards=2), 0))
    server = GeneratorSide(TrainingConfig(workers=2, batch_size=b, seed=1).validate())
    seeded = torch.Generator().manual_seed(derive_seed(config.seed, "dp-feedback-noise", 0))
    print(f"checkout {os.path.abspath(args.repo)}; C = {c}")
    for answer in range(args.answers):
        sent = side.step(server.generate(1).for_worker(0)).feedback.double().reshape(b, -1) * b  # (b, 784)
        noise = torch.normal(0.0, c, size=tuple(sent.shape), generator=seeded).double()
        left = (sent - noise).norm(dim=1)
        print(f"answer {answer}: rows sent {[round(x, 3) for x in sent.norm(dim=1).tolist()[:3]]} ...; "
              f"the seed's noise taken off: {[round(x, 4) for x in left.tolist()]}")


if __name__ == "__main__":
    main()
