"""Draw samples from a finished run's generator: `mdgan sample RUN --n N --out FILE.npy|FILE.png`."""

from __future__ import annotations

import math
import os

import numpy as np
import torch

from mdgan.config import ConfigError, ModelSpec
from mdgan.models import build_generator, image_shape


def load_generator(run_dir: str) -> torch.nn.Module:
    path = os.path.join(run_dir, "checkpoint.pt")
    if not os.path.exists(path):
        raise ConfigError(f"no checkpoint.pt in {run_dir}")
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)  # our own file, plain tensors and dicts
    model = dict(checkpoint["config"]["model"])
    model["sample_shape"] = tuple(model["sample_shape"])
    generator = build_generator(ModelSpec(**model), seed=0)
    generator.load_state_dict(checkpoint["generator"])
    return generator.eval()


def sample_run(run_dir: str, n: int, out: str, seed: int = 0) -> int:
    """Writes n samples; ACGAN classes are balanced (n/C each, the rest from the first classes)."""
    if n < 1:
        raise ConfigError("--n must be at least 1")
    generator = load_generator(run_dir)
    spec = generator.spec
    rng = torch.Generator().manual_seed(seed)
    z = torch.randn(n, spec.latent_dim, generator=rng)  # (n, l)
    labels = torch.arange(n) % spec.num_classes if spec.conditional else None  # (n,)
    if labels is not None:
        labels = labels.sort().values  # grouped by class: rows of a grid read as classes
    with torch.no_grad():
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
