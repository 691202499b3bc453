"""The paper's networks, written plainly.

ACGAN (the paper's setting): G(z, c) is class conditional, D(x) returns 1 + C logits
(source logit first, then class logits). Plain GAN: G(z), D(x) returns one logit.
The class embedding of a conditional G is kept outside the MLP stack so that the stack matches
the paper's parameter counts (G 716,560; D 670,219 for the MNIST MLP).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from mdgan.config import ModelSpec


class MLPGenerator(nn.Module):
    """G = Linear(l->512) -> Linear(512->512) -> Linear(512->d), tanh output in [-1, 1]."""

    def __init__(self, spec: ModelSpec, hidden: int = 512):
        super().__init__()
        self.spec = spec
        # ACGAN conditioning as in the Keras ACGAN example: z is multiplied by a class embedding.
        self.class_embedding = nn.Embedding(spec.num_classes, spec.latent_dim) if spec.conditional else None
        self.stack = nn.Sequential(
            nn.Linear(spec.latent_dim, hidden),
            nn.LeakyReLU(0.2),
            nn.Linear(hidden, hidden),
            nn.LeakyReLU(0.2),
            nn.Linear(hidden, spec.sample_size),
            nn.Tanh(),
        )

    def forward(self, z: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        # z: (B, l); labels: (B,) int64 -> (B, *sample_shape)
        if self.class_embedding is not None:
            if labels is None:
                raise ValueError("a conditional generator needs labels")
            z = z * self.class_embedding(labels)
        return self.stack(z).view(z.shape[0], *self.spec.sample_shape)


class MLPDiscriminator(nn.Module):
    """D = Linear(d->512) -> Linear(512->512) -> Linear(512->1+C) (ACGAN) or (512->1) (GAN)."""

    def __init__(self, spec: ModelSpec, hidden: int = 512):
        super().__init__()
        self.spec = spec
        outputs = 1 + spec.num_classes if spec.conditional else 1
        self.stack = nn.Sequential(
            nn.Linear(spec.sample_size, hidden),
            nn.LeakyReLU(0.2),
            nn.Linear(hidden, hidden),
            nn.LeakyReLU(0.2),
            nn.Linear(hidden, outputs),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, *sample_shape) -> logits (B, 1 [+ C]); column 0 is the real/fake logit
        return self.stack(x.reshape(x.shape[0], -1))


# name -> (generator factory, discriminator factory)
ARCHITECTURES: dict[str, tuple[Callable[[ModelSpec], nn.Module], Callable[[ModelSpec], nn.Module]]] = {
    "mlp": (MLPGenerator, MLPDiscriminator),
}


def _seeded_init(factory: Callable[[ModelSpec], nn.Module], spec: ModelSpec, seed: int) -> nn.Module:
    # Initialise from a private generator so that building a model never depends on, nor moves,
    # the global RNG: both transports then start from the same weights.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return factory(spec)


def build_generator(spec: ModelSpec, seed: int) -> nn.Module:
    spec.validate()
    return _seeded_init(ARCHITECTURES[spec.architecture][0], spec, seed)


def build_discriminator(spec: ModelSpec, seed: int) -> nn.Module:
    spec.validate()
    return _seeded_init(ARCHITECTURES[spec.architecture][1], spec, seed)


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def parameter_report(spec: ModelSpec) -> dict:
    """Parameter counts, with the stacks the paper counts apart from any class embedding."""
    gen = build_generator(spec, seed=0)
    disc = build_discriminator(spec, seed=0)
    embedding = count_parameters(gen.class_embedding) if getattr(gen, "class_embedding", None) is not None else 0
    return {
        "generator": {"stack": count_parameters(gen) - embedding, "class_embedding": embedding,
                      "total": count_parameters(gen)},
        "discriminator": {"stack": count_parameters(disc), "total": count_parameters(disc)},
    }
