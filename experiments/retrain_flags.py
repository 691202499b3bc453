"""What the tools that train a kept run again here share (replay.py, first_evaluation.py): the repository
on the import path, and the flags that say where MNIST is and how many threads torch may use."""

from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # (mdgan_app without an install)
DATA = os.path.join(os.path.dirname(REPO), "shared", "data")


def _at_least_one(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"a whole number >= 1, not {text!r}")
    return int(text)


def add_retrain_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-root", default=DATA, help=f"where MNIST is (default: {DATA})")
    parser.add_argument("--threads", type=_at_least_one, default=1,
                        help="torch threads (default: 1, as `mdgan experiment` runs; more may sum in another order)")


def use_threads(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
