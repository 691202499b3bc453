"""The paper's networks, written plainly.

ACGAN (the paper's setting): G(z, c) is class conditional, D(x) returns 1 + C logits
(source logit first, then class logits). Plain GAN: G(z), D(x) returns one logit.
The class embedding of a conditional G is kept outside the MLP stack so that the stack matches
the paper's parameter counts (G 716,560; D 670,219 for the MNIST MLP).

Samples are flat everywhere outside this module: G returns (B, d) and D takes (B, d); the CNNs
reshape to (B, C, H, W) inside (see image_shape). docs/ARCHITECTURES.md lists every layer and
compares the parameter counts with the paper's.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch
from torch import nn

from mdgan.config import ARCHITECTURE_NAMES, ConfigError, ModelSpec


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
    """D = Linear(d->w) -> Linear(w->w) -> Linear(w->1+C) (ACGAN) or (w->1) (GAN); w = spec.disc_width, the
    paper's 512 by default."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        hidden = spec.disc_width
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


def image_shape(d: int) -> tuple[int, int, int]:
    """(C, H, W) of a flat sample of d floats: 784 -> (1, 28, 28), 3072 -> (3, 32, 32).

    Grey square images first (d = s*s), then RGB square images (d = 3*s*s).
    """
    for channels in (1, 3):
        side = math.isqrt(d // channels)
        if d % channels == 0 and channels * side * side == d:
            return channels, side, side
    raise ValueError(f"a sample of {d} floats is not a square grey or RGB image")


def _require_sample_shape(spec: ModelSpec, image: tuple[int, int, int], name: str) -> None:
    d = image[0] * image[1] * image[2]
    if tuple(spec.sample_shape) != (d,):
        raise ConfigError(f"{name} works on {image[0]}x{image[1]}x{image[2]} images, i.e. flat samples of shape "
                          f"({d},); the model spec has sample_shape {tuple(spec.sample_shape)}")


CNN_MNIST_IMAGE = (1, 28, 28)
CNN_CIFAR10_IMAGE = (3, 32, 32)
CNN_DISC_CHANNELS = (16, 32, 64, 128, 256, 512)  # the paper's six 3x3 convolutions (both datasets)


class MinibatchDiscrimination(nn.Module):
    """Minibatch discrimination (Salimans et al. 2016, section 3.2), as a layer.

    f (B, A) -> M = f T, reshaped (B, K, C) (K kernels of dimension C);
    o(x_i)_k = sum_{j != i} exp(-||M_i,k - M_j,k||_1); output concat(f, o): (B, A + K).
    The sample itself is left out of the sum, as in Salimans et al.'s code, so a batch of one
    gets o = 0. D's output for a sample then depends on the other samples of its batch.
    """

    def __init__(self, in_features: int, num_kernels: int = 5, kernel_dim: int = 3):
        super().__init__()
        self.num_kernels = num_kernels
        self.kernel_dim = kernel_dim
        # T: (A, K*C), no bias (as in Salimans et al. and the Keras layer).
        self.T = nn.Parameter(torch.randn(in_features, num_kernels * kernel_dim) * in_features ** -0.5)

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        # f: (B, A) -> (B, A + K)
        m = (f @ self.T).view(f.shape[0], self.num_kernels, self.kernel_dim)  # (B, K, C)
        distances = (m.unsqueeze(1) - m.unsqueeze(0)).abs().sum(dim=3)  # (B, B, K): L1 between i and j
        closeness = torch.exp(-distances)  # (B, B, K)
        o = closeness.sum(dim=1) - 1.0  # (B, K): drop j == i (distance 0, exp(0) = 1)
        return torch.cat([f, o], dim=1)


class CNNGenerator(nn.Module):
    """G = Linear(l -> C0*s*s) -> reshape (C0, s, s) -> ConvT 5x5 stride 2 (x len(channels)) -> tanh.

    Each transposed convolution doubles the side (padding 2, output padding 1). ReLU between
    layers, tanh at the end; no batch normalisation (not among the paper's layers). Returns flat
    (B, d) samples like the MLP.
    """

    def __init__(self, spec: ModelSpec, image: tuple[int, int, int], start_channels: int, start_side: int,
                 channels: tuple[int, ...], name: str):
        super().__init__()
        _require_sample_shape(spec, image, name)
        if channels[-1] != image[0] or start_side * 2 ** len(channels) != image[1]:
            raise ValueError(f"{name}: layers do not produce a {image} image")
        self.spec = spec
        self.start = (start_channels, start_side, start_side)
        # ACGAN conditioning as in MLPGenerator: z is multiplied by a class embedding (counted apart).
        self.class_embedding = nn.Embedding(spec.num_classes, spec.latent_dim) if spec.conditional else None
        self.project = nn.Sequential(nn.Linear(spec.latent_dim, start_channels * start_side * start_side), nn.ReLU())
        layers: list[nn.Module] = []
        c_in = start_channels
        for i, c_out in enumerate(channels):
            layers.append(nn.ConvTranspose2d(c_in, c_out, kernel_size=5, stride=2, padding=2, output_padding=1))
            layers.append(nn.Tanh() if i == len(channels) - 1 else nn.ReLU())
            c_in = c_out
        self.deconv = nn.Sequential(*layers)

    def forward(self, z: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        # z: (B, l); labels: (B,) int64 -> (B, d) flat, in [-1, 1]
        if self.class_embedding is not None:
            if labels is None:
                raise ValueError("a conditional generator needs labels")
            z = z * self.class_embedding(labels)
        h = self.project(z).view(z.shape[0], *self.start)  # (B, C0, s, s)
        x = self.deconv(h)  # (B, C, H, W)
        return x.reshape(x.shape[0], -1)  # (B, d), channel-first order


class CNNDiscriminator(nn.Module):
    """D = six Conv 3x3 (16..512 kernels, strides 2,1,2,1,2,1, LeakyReLU 0.2) -> flatten
    -> minibatch discrimination -> Linear(-> 1+C) (ACGAN) or (-> 1) (GAN)."""

    def __init__(self, spec: ModelSpec, image: tuple[int, int, int], name: str,
                 channels: tuple[int, ...] = CNN_DISC_CHANNELS, num_kernels: int = 5, kernel_dim: int = 3):
        super().__init__()
        _require_sample_shape(spec, image, name)
        self.spec = spec
        self.image = image
        outputs = 1 + spec.num_classes if spec.conditional else 1
        layers: list[nn.Module] = []
        c_in, side = image[0], image[1]
        for i, c_out in enumerate(channels):
            stride = 2 if i % 2 == 0 else 1
            layers.append(nn.Conv2d(c_in, c_out, kernel_size=3, stride=stride, padding=1))
            layers.append(nn.LeakyReLU(0.2))
            c_in, side = c_out, (side - 1) // stride + 1
        layers.append(nn.Flatten())
        self.features = nn.Sequential(*layers)
        flat = c_in * side * side  # 512*4*4 = 8192 for 28x28 and for 32x32
        self.minibatch = MinibatchDiscrimination(flat, num_kernels, kernel_dim)
        self.head = nn.Linear(flat + num_kernels, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, d) flat (or (B, C, H, W)) -> logits (B, 1 [+ C]); column 0 is the real/fake logit
        h = self.features(x.reshape(x.shape[0], *self.image))  # (B, 8192)
        return self.head(self.minibatch(h))  # (B, 8192 + K) -> (B, outputs)


class CNNMNISTGenerator(CNNGenerator):
    """Paper, MNIST CNN: Linear(100 -> 6,272 = 128x7x7) -> ConvT(128->32, 5x5) 14x14 -> ConvT(32->1, 5x5) 28x28."""

    def __init__(self, spec: ModelSpec):
        super().__init__(spec, CNN_MNIST_IMAGE, start_channels=128, start_side=7, channels=(32, 1), name="cnn-mnist")


class CNNMNISTDiscriminator(CNNDiscriminator):
    """Paper, MNIST CNN: 1x28x28 -> 16x14x14 -> 32x14x14 -> 64x7x7 -> 128x7x7 -> 256x4x4 -> 512x4x4."""

    def __init__(self, spec: ModelSpec):
        super().__init__(spec, CNN_MNIST_IMAGE, name="cnn-mnist")


class CNNCIFAR10Generator(CNNGenerator):
    """Paper, CIFAR10 CNN: Linear(100 -> 6,144 = 384x4x4) -> ConvT 192 8x8 -> ConvT 96 16x16 -> ConvT 3 32x32."""

    def __init__(self, spec: ModelSpec):
        super().__init__(spec, CNN_CIFAR10_IMAGE, start_channels=384, start_side=4, channels=(192, 96, 3),
                         name="cnn-cifar10")


class CNNCIFAR10Discriminator(CNNDiscriminator):
    """Paper, CIFAR10 CNN: 3x32x32 -> 16x16x16 -> 32x16x16 -> 64x8x8 -> 128x8x8 -> 256x4x4 -> 512x4x4."""

    def __init__(self, spec: ModelSpec):
        super().__init__(spec, CNN_CIFAR10_IMAGE, name="cnn-cifar10")


# name -> (generator factory, discriminator factory)
ARCHITECTURES: dict[str, tuple[Callable[[ModelSpec], nn.Module], Callable[[ModelSpec], nn.Module]]] = {
    "mlp": (MLPGenerator, MLPDiscriminator),
    "cnn-mnist": (CNNMNISTGenerator, CNNMNISTDiscriminator),
    "cnn-cifar10": (CNNCIFAR10Generator, CNNCIFAR10Discriminator),
}
# config.py validates the names before anything is built; both lists must name the same architectures
assert tuple(ARCHITECTURES) == ARCHITECTURE_NAMES, "mdgan/config.py's ARCHITECTURE_NAMES and ARCHITECTURES differ"

# The flat sample shape an architecture is built for; None: any (the MLP adapts to d).
ARCHITECTURE_SAMPLE_SHAPES: dict[str, tuple[int, ...] | None] = {
    "mlp": None,
    "cnn-mnist": (math.prod(CNN_MNIST_IMAGE),),  # (784,)
    "cnn-cifar10": (math.prod(CNN_CIFAR10_IMAGE),),  # (3072,)
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
    """Parameter counts, with the stacks the paper counts apart from any class embedding.

    An architecture built for one image size (the CNNs) is counted at that size, whatever
    spec.sample_shape says (`mdgan models` passes the default (784,) for every architecture).
    """
    native = ARCHITECTURE_SAMPLE_SHAPES.get(spec.architecture)
    if native is not None:
        spec = dataclasses.replace(spec, sample_shape=native)
    gen = build_generator(spec, seed=0)
    disc = build_discriminator(spec, seed=0)
    embedding = count_parameters(gen.class_embedding) if getattr(gen, "class_embedding", None) is not None else 0
    return {
        "generator": {"stack": count_parameters(gen) - embedding, "class_embedding": embedding,
                      "total": count_parameters(gen)},
        "discriminator": {"stack": count_parameters(disc), "total": count_parameters(disc)},
    }
