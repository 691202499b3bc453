"""What the tools that train a kept run again here share (replay.py, first_evaluation.py): the repository
on the import path, and the flags that say where MNIST is and how many threads torch may use."""

from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # (mdgan_app without an install)
DATA = os.path.join(os.path.dirname(REPO), "shared", "data")


def add_retrain_flags(parser: argparse.ArgumentParser) -> None:
    from services.common.settings import non_negative_int

    parser.add_argument("--data-root", default=DATA, help=f"where MNIST is (default: {DATA})")
    parser.add_argument("--threads", type=non_negative_int, default=1,
                        help="torch threads (default: 1, as `mdgan experiment` runs; 0: torch's default; more than "
                             "one may sum in another order)")


def use_threads(args: argparse.Namespace) -> None:
    """As `mdgan experiment --threads` sets its process up (torch's threads, the allocator)."""
    from services.common.settings import configure_compute

    configure_compute(args.threads)
