"""Datasets and shards. A worker loads the dataset, keeps its own shard and never sends a sample.

Images are float32 in [-1, 1] (the range of G's tanh), shaped like the model's samples.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from mdgan.config import ConfigError, DataConfig

SYNTHETIC_SIZE = 2000
SYNTHETIC_SEED = 1234  # fixed: every worker must build the same synthetic dataset


@dataclass(frozen=True)
class Shard:
    images: torch.Tensor  # (m, *sample_shape) float32 in [-1, 1]
    labels: torch.Tensor  # (m,) int64
    index: int
    num_shards: int

    def __len__(self) -> int:
        return self.images.shape[0]


def load_mnist(data_root: str, train: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """MNIST from torchvision's layout (DATA_ROOT/MNIST/raw/*-idx*-ubyte); never downloads."""
    from torchvision.datasets import MNIST

    raw = os.path.join(data_root, "MNIST", "raw")
    if not os.path.isdir(raw):
        raise ConfigError(
            f"MNIST not found under {raw!r}: point --data-root at a folder holding MNIST/raw "
            "(torchvision.datasets.MNIST(root, download=True) creates one)"
        )
    dataset = MNIST(root=data_root, train=train, download=False)
    images = dataset.data.reshape(-1, 28 * 28).to(torch.float32).div_(127.5).sub_(1.0)  # (n, 784)
    return images, dataset.targets.to(torch.int64)


def make_synthetic(size: int = SYNTHETIC_SIZE, dim: int = 784, num_classes: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """A small labelled dataset for smoke runs: one random prototype per class plus noise."""
    rng = torch.Generator().manual_seed(SYNTHETIC_SEED)
    prototypes = torch.rand(num_classes, dim, generator=rng) * 2 - 1  # (C, d)
    labels = torch.randint(0, num_classes, (size,), generator=rng)  # (size,)
    noise = 0.3 * torch.randn(size, dim, generator=rng)
    return (prototypes[labels] + noise).clamp_(-1, 1), labels


def load_dataset(config: DataConfig) -> tuple[torch.Tensor, torch.Tensor]:
    config.validate()
    if config.dataset == "mnist":
        return load_mnist(config.data_root)
    return make_synthetic()


def iid_shard_indices(size: int, num_shards: int, seed: int) -> list[torch.Tensor]:
    """A seeded random permutation cut into num_shards contiguous pieces (sizes differ by <= 1)."""
    if num_shards > size:
        raise ConfigError(f"cannot split {size} samples into {num_shards} shards")
    order = torch.randperm(size, generator=torch.Generator().manual_seed(seed))
    return list(torch.tensor_split(order, num_shards))


def shard_sizes(size: int, num_shards: int) -> list[int]:
    """The sizes of the i.i.d. shards (the first size % num_shards shards hold one sample more)."""
    return [size // num_shards + (1 if i < size % num_shards else 0) for i in range(num_shards)]


def take_shard(images: torch.Tensor, labels: torch.Tensor, index: int, config: DataConfig,
               sample_shape: tuple[int, ...] = (784,)) -> Shard:
    """Shard `index` of `config.num_shards` of an already loaded dataset."""
    if not 0 <= index < config.num_shards:
        raise ConfigError(f"shard index {index} out of range for {config.num_shards} shards")
    picked = iid_shard_indices(images.shape[0], config.num_shards, config.split_seed)[index]
    return Shard(images[picked].reshape(-1, *sample_shape).contiguous(), labels[picked].contiguous(),
                 index, config.num_shards)


def load_shard(config: DataConfig, index: int, sample_shape: tuple[int, ...] = (784,)) -> Shard:
    config.validate()
    if not 0 <= index < config.num_shards:
        raise ConfigError(f"shard index {index} out of range for {config.num_shards} shards")
    images, labels = load_dataset(config)
    return take_shard(images, labels, index, config, sample_shape)


def load_all_shards(config: DataConfig, sample_shape: tuple[int, ...] = (784,)) -> list[Shard]:
    """Every shard at once (the in-process cluster), loading the dataset a single time."""
    images, labels = load_dataset(config.validate())
    return [take_shard(images, labels, i, config, sample_shape) for i in range(config.num_shards)]


class ShardSampler:
    """Draws batches of b real samples from a shard, epoch by epoch (a fresh permutation per epoch)."""

    def __init__(self, shard: Shard, batch_size: int, seed: int):
        if len(shard) < batch_size:
            raise ConfigError(f"shard {shard.index} has {len(shard)} samples, fewer than a batch of {batch_size}")
        self.shard = shard
        self.batch_size = batch_size
        self._rng = torch.Generator().manual_seed(seed)
        self._order = torch.randperm(len(shard), generator=self._rng)
        self._position = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        # -> images (b, *sample_shape), labels (b,); the tail of an epoch shorter than b is skipped
        if self._position + self.batch_size > len(self.shard):
            self._order = torch.randperm(len(self.shard), generator=self._rng)
            self._position = 0
        picked = self._order[self._position:self._position + self.batch_size]
        self._position += self.batch_size
        return self.shard.images[picked], self.shard.labels[picked]
