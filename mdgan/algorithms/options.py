"""The flags of the P-WGAN and data-parallel runs (every one also an MDGAN_<FLAG> variable)."""

from __future__ import annotations

import argparse

from mdgan.algorithms.dpgan import DPGANOptions
from mdgan.algorithms.pwgan import PWGANOptions


def add_algorithm_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("P-WGAN (--algorithm pwgan) and data-parallel GAN (--algorithm dpgan)")
    defaults = PWGANOptions()
    g.add_argument("--potential-rounds", type=int, default=defaults.potential_rounds,
                   help="pwgan: T, rounds of the Kantorovich potentials per iteration")
    g.add_argument("--potential-lr", type=float, default=defaults.potential_lr,
                   help="pwgan: eta, step of the potentials' ascent (on masses)")
    g.add_argument("--gradient-penalty", type=float, default=defaults.gradient_penalty,
                   help="pwgan: lambda of the critics' gradient penalty")
    g.add_argument("--dp-threshold", type=int, default=None,
                   help="dpgan: gradients a step needs (default: every worker; fewer tolerates losses)")


def pwgan_options(args: argparse.Namespace) -> PWGANOptions:
    return PWGANOptions(args.potential_rounds, args.potential_lr, args.gradient_penalty).validate()


def dpgan_options(args: argparse.Namespace, workers: int) -> DPGANOptions:
    options = DPGANOptions(args.dp_threshold)
    options.resolve(workers)  # refused here, before anything runs
    return options
