"""A finished run, from Python (`mdgan.load_run`), and samples of its generator (`mdgan sample RUN ...`).

    >>> import mdgan
    >>> run = mdgan.load_run("runs/local")                  # doctest: +SKIP
    >>> run.scores["mnist_score"], run.config.workers        # doctest: +SKIP
    >>> images, labels = run.sample(20, classes=[3, 7])     # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import math
import os

import numpy as np
import torch

import json
from dataclasses import dataclass

from mdgan import checkpoint
from mdgan.config import ConfigError, ModelSpec, TrainingConfig, named
from mdgan.models import build_generator, image_shape


def load_generator(run_dir: str, device: str | torch.device = "cpu") -> torch.nn.Module:
    path = os.path.join(run_dir, "checkpoint.pt")
    if not os.path.exists(path):
        raise ConfigError(f"no checkpoint.pt in {run_dir}: is it the folder of a finished run (--out)?")
    saved = checkpoint.load(path)  # (CheckpointError, in one line, when it cannot be read)
    try:
        model = dict(saved["config"]["model"])
        model["sample_shape"] = tuple(model["sample_shape"])
        generator = build_generator(ModelSpec(**model), seed=0)
        generator.load_state_dict(saved["generator"])
    except Exception as exc:  # not a run's, or its generator not the one its config names
        raise ConfigError(f"{path}: not a run's generator checkpoint ({_first_line(exc)})") from None
    return generator.eval().to(device)


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def read_summary(run_dir: str) -> dict:
    """A finished run's summary.json, with its config; ConfigError, in one line, for anything else."""
    path = os.path.join(run_dir, "summary.json")
    try:
        with open(path, encoding="utf-8") as fh:
            summary = json.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"no summary.json in {run_dir}: is it the folder of a finished run (--out)?") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"{path}: not a run's summary (not JSON: {exc})") from None
    if not isinstance(summary, dict) or not isinstance(summary.get("config"), dict):
        raise ConfigError(f"{path}: not a run's summary (no config)")
    return summary


@dataclass
class Run:
    """A finished run: its generator (in eval mode, on `device`), its config and its summary."""

    path: str
    generator: torch.nn.Module
    config: TrainingConfig
    summary: dict

    @property
    def scores(self) -> dict:
        """The final generator's scores ({"mnist_score", "fid", ...}; empty when it was not scored)."""
        return dict(self.summary.get("scores") or {})

    @property
    def device(self) -> torch.device:
        return next(self.generator.parameters()).device

    def sample(self, n: int, classes=None, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """n samples (n, *sample_shape) in [-1, 1] on the generator's device, and their labels (n,) for ACGAN
        (None for a plain GAN). classes: the labels to draw, in turn (default: every class, balanced)."""
        spec = self.generator.spec
        if n < 1:
            raise ConfigError("n must be at least 1")
        rng = torch.Generator().manual_seed(seed)
        z = torch.randn(n, spec.latent_dim, generator=rng)  # (n, l), drawn on the CPU: the same on any device
        labels = None
        if spec.conditional:
            wanted = torch.as_tensor(list(range(spec.num_classes)) if classes is None else list(classes))
            if wanted.numel() == 0 or wanted.min() < 0 or wanted.max() >= spec.num_classes:
                raise ConfigError(f"classes must be labels in [0, {spec.num_classes})")
            labels = wanted[torch.arange(n) % wanted.numel()]  # (n,)
        elif classes is not None:
            raise ConfigError(f"this run trained a plain GAN ({named('gan')} gan): its samples have no classes")
        with torch.no_grad():
            samples = self.generator(z.to(self.device), None if labels is None else labels.to(self.device))
        return samples.reshape(n, *spec.sample_shape), labels


def load_run(path: str, device: str | torch.device = "cpu") -> Run:
    """A finished run from its folder (what `mdgan local|simulate --out` wrote), on CPU or CUDA."""
    summary = read_summary(path)
    try:
        config = TrainingConfig.from_dict(summary["config"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{os.path.join(path, 'summary.json')}: not a run's config ({_first_line(exc)})") from None
    return Run(path, load_generator(path, device), config, summary)


@contextlib.contextmanager
def _memory_for(n: int, spec: ModelSpec):
    """Drawing n samples at once: where memory runs out, one line saying how much they need."""
    try:
        yield
    except (MemoryError, RuntimeError) as exc:
        if not isinstance(exc, MemoryError) and "alloc" not in str(exc) and "out of memory" not in str(exc):
            raise
        need = n * (spec.latent_dim + spec.sample_size) * 4
        raise ConfigError(f"--n {n:,}: not enough memory to draw that many samples at once (about {need / 1e9:.1f} "
                          f"GB); draw fewer, several times with other {named('seed')} values") from None


def sample_run(run_dir: str, n: int, out: str, seed: int = 0) -> int:
    """Writes n samples; ACGAN classes are balanced (n/C each, the rest from the first classes)."""
    if n < 1:
        raise ConfigError("--n must be at least 1")
    generator = load_generator(run_dir)
    spec = generator.spec
    rng = torch.Generator().manual_seed(seed)
    with _memory_for(n, spec):
        z = torch.randn(n, spec.latent_dim, generator=rng)  # (n, l), on the CPU, where load_generator put G
    labels = torch.arange(n) % spec.num_classes if spec.conditional else None  # (n,)
    if labels is not None:
        labels = labels.sort().values  # grouped by class: rows of a grid read as classes
    with torch.no_grad(), _memory_for(n, spec):
        samples = generator(z, labels)  # (n, d) in [-1, 1]
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    if out.endswith(".npy"):
        np.save(out, samples.numpy().astype(np.float32))
        if labels is not None:
            np.save(out[:-4] + ".labels.npy", labels.numpy())
    elif out.endswith(".png"):
        from torchvision.utils import save_image

        images = samples.reshape(n, *image_shape(spec.sample_size))
        nrow = max(1, n // spec.num_classes) if spec.conditional else max(1, math.isqrt(n))
        save_image(images, out, nrow=nrow, normalize=True, value_range=(-1, 1))
    else:
        raise ConfigError(f"--out must end in .npy or .png, got {out!r}")
    return n
