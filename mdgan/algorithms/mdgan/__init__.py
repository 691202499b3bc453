"""MD-GAN (Hardy, Le Merrer, Sericola, IPDPS 2019): one generator on the server, one discriminator
per worker, generated batches down and per-sample feedback up every iteration, discriminators
swapped peer to peer every ceil(E*m/b) iterations.

- trainer.py: the training loop over abstract worker handles (membership, swaps, copies to late
  joiners, checkpoints); what a handle must do (WorkerHandle) and the swap orders.
- synchrony.py: --sync quorum|async, an iteration that waits for some of the workers, not all.
- checkpoints.py: what the server's part of a checkpoint holds.
- inprocess.py: the in-process worker handle and the whole `mdgan simulate` run.
- swapcheck.py: a received discriminator is checked before it replaces the receiver's.
- options.py: MD-GAN's own options (the swap check's settings, the swap lag).
The two sides' math (GeneratorSide, DiscriminatorSide) is mdgan/gan.py, shared by every algorithm.
"""

from __future__ import annotations

import math

from mdgan.algorithms.base import DIRECTIONS, Algorithm
from mdgan.algorithms.mdgan.inprocess import run_in_process
from mdgan.algorithms.mdgan.options import MDGANOptions
from mdgan.algorithms.traffic import discriminator_state_bytes
from mdgan.config import TrainingConfig


def per_worker_per_iteration(config: TrainingConfig, shard_size: int, options=None) -> dict[str, float]:
    """The paper's Table III per worker per iteration: 2 b d floats down, b d up, |theta| per swap
    (every S = ceil(E m / b) iterations; none with private feedback), in the wire's dtype."""
    from mdgan.compression import packed_nbytes

    sample = packed_nbytes((config.batch_size, config.model.sample_size), config.wire_dtype)
    period = config.swap_period(shard_size)
    return {"server_to_worker": 2 * sample, "worker_to_server": sample,
            "worker_to_worker": 0.0 if period is None
            else discriminator_state_bytes(config.to_dict(), config.wire_dtype) / period}


def run_traffic(summary: dict, history: list[dict], swaps: list[dict]):
    """Table III evaluated with the workers active in each iteration, the feedback sent and the
    discriminators pushed, so it holds exactly for runs where workers failed too: (formula, the same
    as its lower bound, the formula at float32)."""
    from mdgan.compression import packed_nbytes

    config = summary["config"]
    wire = config.get("wire_dtype", "float32")
    b, d = config["batch_size"], math.prod(config["model"]["sample_shape"])
    counts = {"server_to_worker": 2 * sum(r["active_workers"] for r in history),  # tensors of b*d floats
              # late answers (--sync quorum|async) travelled too, and were dropped on arrival
              "worker_to_server": sum(r["answered"] + r["rejected"] + r.get("late", 0) for r in history),
              "worker_to_worker": sum(1 for s in swaps for w in s["workers"].values() if w["sent"])}
    per_tensor = {"server_to_worker": packed_nbytes((b, d), wire), "worker_to_server": packed_nbytes((b, d), wire),
                  "worker_to_worker": discriminator_state_bytes(config, wire)}
    per_tensor_fp32 = {"server_to_worker": b * d * 4, "worker_to_server": b * d * 4,
                       "worker_to_worker": discriminator_state_bytes(config)}
    formula = {k: counts[k] * per_tensor[k] for k in DIRECTIONS}
    return formula, formula, {k: counts[k] * per_tensor_fp32[k] for k in DIRECTIONS}


ALGORITHM = Algorithm(
    name="mdgan", title="MD-GAN", run_in_process=run_in_process, per_worker_per_iteration=per_worker_per_iteration,
    run_traffic=run_traffic, options=MDGANOptions, durable=True, resumable=True, attackers=True,
    private=("sgd", "feedback"))
