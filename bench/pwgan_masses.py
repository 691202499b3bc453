"""How much of the generated batch P-WGAN's coupling reaches: the round-T cells against the plan
averaged over the T rounds (docs/ALGORITHMS.md, "Choices").

    python bench/pwgan_masses.py --data-root ../shared/data --iterations 150 --skip 50 --eta 1 3

For each eta it trains P-WGAN in one process on MNIST (MLP ACGAN, 2 workers, b = 10) and prints,
over iterations skip+1..I, the mean share of generated points with no mass and the mean largest
mass (uniform: 1/b), under the last round's counts and under the averaged plan, both measured on
the same run.
"""

from __future__ import annotations

import argparse
import asyncio

import torch

from mdgan.algorithms.pwgan import PWGANOptions, PWGANTrainer, build_in_process_critics
from mdgan.config import DataConfig, TrainingConfig
from mdgan.data import load_all_shards
from mdgan.gan import GeneratorSide


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-root", default="data")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=150)
    parser.add_argument("--skip", type=int, default=50, help="iterations left out of the means (the start)")
    parser.add_argument("--rounds", type=int, default=5, help="T")
    parser.add_argument("--eta", type=float, nargs="+", default=[1.0])
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = TrainingConfig(workers=args.workers, iterations=args.iterations, batch_size=10).validate()
    shards = load_all_shards(DataConfig("mnist", args.data_root, num_shards=args.workers), config.model.sample_shape)
    print(f"{'eta':>6} {'empty (round T)':>16} {'max (round T)':>14} {'empty (plan)':>13} {'max (plan)':>11}")
    for eta in args.eta:
        options = PWGANOptions(potential_rounds=args.rounds, potential_lr=eta)
        trainer = PWGANTrainer(config, options, GeneratorSide(config), build_in_process_critics(config, options, shards))
        rows = []

        async def train():
            for t in range(1, config.iterations + 1):
                await trainer.iteration(t)
                if t > args.skip:
                    last, plan = trainer.last_round_masses, trainer.masses
                    rows.append([(last == 0).float().mean().item(), last.max().item(),
                                 (plan == 0).float().mean().item(), plan.max().item()])

        asyncio.run(train())
        empty_t, max_t, empty_p, max_p = torch.tensor(rows).mean(0).tolist()
        print(f"{eta:6g} {empty_t:16.3f} {max_t:14.3f} {empty_p:13.3f} {max_p:11.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
