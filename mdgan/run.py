"""What a run leaves behind: history.jsonl, summary.json, sample grids, a checkpoint.

Used by the in-process simulation and by the gRPC server alike, so both write the same files.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import time
from dataclasses import asdict

import torch
from tqdm import tqdm

from mdgan.cluster import IterationRecord, RunResult, Trainer, build_in_process_workers
from mdgan.config import DataConfig, TrainingConfig
from mdgan.data import load_all_shards
from mdgan.mdgan import GeneratorSide, derive_seed


def generator_sha256(generator: torch.nn.Module) -> str:
    """A hash of the generator's parameters and buffers (names, shapes, dtypes and raw bytes)."""
    digest = hashlib.sha256()
    for name, tensor in generator.state_dict().items():
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def _finite_or_none(value: float) -> float | None:
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


class RunRecorder:
    """Writes history.jsonl and swaps.jsonl line by line (so `tail -f` works); drives the progress bar."""

    def __init__(self, out_dir: str, total: int, progress: bool = True, description: str = "mdgan"):
        os.makedirs(out_dir, exist_ok=True)
        self.out_dir = out_dir
        self._history = open(os.path.join(out_dir, "history.jsonl"), "w", encoding="utf-8")
        self._swaps = open(os.path.join(out_dir, "swaps.jsonl"), "w", encoding="utf-8")
        self._bar = tqdm(total=total, desc=description, unit="it", disable=not progress, dynamic_ncols=True)
        self.started = time.perf_counter()

    def __call__(self, record: IterationRecord) -> None:
        row = {k: (_finite_or_none(v) if isinstance(v, float) else v) for k, v in asdict(record).items()}
        self._history.write(json.dumps(row) + "\n")
        self._history.flush()
        self._bar.update(1)
        self._bar.set_postfix(workers=record.active_workers, g=f"{record.gen_loss:.3f}", d=f"{record.disc_loss:.3f}",
                              refresh=False)

    def swap(self, record: dict) -> None:
        """One line per swap round: the plan (sender -> receiver) and what each worker reported."""
        self._swaps.write(json.dumps(record) + "\n")
        self._swaps.flush()

    def close(self) -> float:
        self._bar.close()
        self._history.close()
        self._swaps.close()
        return time.perf_counter() - self.started


def save_sample_grid(generator_side: GeneratorSide, path: str, per_class: int = 10) -> None:
    """A grid of samples from fixed noise: one row per class for ACGAN (class-balanced)."""
    from torchvision.utils import save_image

    spec = generator_side.spec
    rng = torch.Generator().manual_seed(derive_seed(generator_side.config.seed, "sample-grid"))
    if spec.conditional:
        labels = torch.arange(spec.num_classes).repeat_interleave(per_class)  # (C*per_class,)
        nrow = per_class
    else:
        labels, nrow = None, 10
    count = spec.num_classes * per_class if spec.conditional else 100
    z = torch.randn(count, spec.latent_dim, generator=rng)
    images = generator_side.sample(z, labels)
    side = math.isqrt(spec.sample_size)
    if side * side == spec.sample_size:  # grey square images (MNIST-like)
        images = images.reshape(count, 1, side, side)
    elif images.dim() != 4:
        return  # samples are not images: no grid
    save_image(images, path, nrow=nrow, normalize=True, value_range=(-1, 1))


def write_outputs(out_dir: str, config: TrainingConfig, generator_side: GeneratorSide, result: RunResult,
                  wall_seconds: float, mode: str, extra: dict | None = None) -> dict:
    """summary.json, samples.png and checkpoint.pt; returns the summary."""
    os.makedirs(out_dir, exist_ok=True)
    last = result.last
    summary = {
        "mode": mode,
        "iterations": result.iterations,
        "workers": result.workers,
        "workers_alive": result.workers_alive,
        "wall_seconds": wall_seconds,
        "seconds_per_iteration": wall_seconds / result.iterations if result.iterations else None,
        "generator_sha256": generator_sha256(generator_side.generator),
        "payload_bytes": dict(result.traffic.payload_bytes),
        "label_bytes": result.traffic.label_bytes,
        "swaps": result.swaps,
        "swap_period": result.swap_period,
        "rejections": result.rejections,
        "stopped_early": result.stopped_early,
        "final": {
            "gen_loss": _finite_or_none(last.gen_loss) if last else None,
            "disc_loss": _finite_or_none(last.disc_loss) if last else None,
            "real_accuracy": _finite_or_none(last.real_accuracy) if last else None,
            "fake_accuracy": _finite_or_none(last.fake_accuracy) if last else None,
        },
        "config": config.to_dict(),
    }
    summary.update(extra or {})
    save_sample_grid(generator_side, os.path.join(out_dir, "samples.png"))
    torch.save({"generator": generator_side.generator.state_dict(),
                "optimizer": generator_side.optimizer.state_dict(),
                "config": config.to_dict(), "iterations": result.iterations},
               os.path.join(out_dir, "checkpoint.pt"))
    with open(os.path.join(out_dir, "summary.json"), "w", encoding="utf-8") as fh:
        json.dump(summary, fh, indent=2)
        fh.write("\n")
    return summary


def simulate(config: TrainingConfig, data: DataConfig, out_dir: str, progress: bool = True) -> dict:
    """The whole run in this process: every worker is an object, the loop is the same."""
    config.validate()
    data = DataConfig(data.dataset, data.data_root, config.workers, data.split_seed).validate()
    shards = load_all_shards(data, config.model.sample_shape)
    generator_side = GeneratorSide(config)
    workers = build_in_process_workers(config, shards)
    recorder = RunRecorder(out_dir, config.iterations, progress, "simulate")
    trainer = Trainer(config, generator_side, workers, on_iteration=recorder, on_swap=recorder.swap)
    try:
        result = asyncio.run(trainer.run())
    finally:
        wall = recorder.close()
    return write_outputs(out_dir, config, generator_side, result, wall, "simulate")
