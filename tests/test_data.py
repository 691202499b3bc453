import pytest
import torch

from mdgan.config import ConfigError, DataConfig
from mdgan.data import (ShardSampler, iid_shard_indices, load_all_shards, load_mnist, load_shard, make_synthetic,
                        shard_sizes)


@pytest.mark.parametrize("size,n", [(60000, 10), (60000, 7), (2000, 3), (11, 11)])
def test_iid_shards_partition_the_dataset(size, n):
    pieces = iid_shard_indices(size, n, seed=3)
    assert [len(p) for p in pieces] == shard_sizes(size, n)
    everything = torch.cat(pieces)
    assert torch.equal(everything.sort().values, torch.arange(size))  # disjoint and complete
    assert not torch.equal(everything, torch.arange(size))  # shuffled, not contiguous
    assert max(map(len, pieces)) - min(map(len, pieces)) <= 1


def test_split_is_seeded():
    a, b, c = (iid_shard_indices(100, 4, s) for s in (1, 1, 2))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


def test_too_many_shards_is_an_error():
    with pytest.raises(ConfigError):
        iid_shard_indices(3, 4, 0)


def test_synthetic_dataset_is_deterministic_and_in_range():
    (x1, y1), (x2, y2) = make_synthetic(), make_synthetic()
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert x1.shape == (2000, 784) and float(x1.abs().max()) <= 1
    assert set(y1.tolist()) == set(range(10))


def test_one_shard_equals_the_same_piece_of_all_shards():
    config = DataConfig("synthetic", num_shards=3, split_seed=5)
    shards = load_all_shards(config)
    one = load_shard(config, 1)
    assert torch.equal(one.images, shards[1].images) and torch.equal(one.labels, shards[1].labels)
    with pytest.raises(ConfigError):
        load_shard(config, 3)


def test_sampler_visits_every_sample_once_per_epoch():
    shard = load_shard(DataConfig("synthetic", num_shards=20), 0)  # 100 samples
    sampler = ShardSampler(shard, batch_size=10, seed=0)
    seen = torch.cat([sampler.next_batch()[0] for _ in range(10)])
    assert seen.unique(dim=0).shape[0] == 100
    again = ShardSampler(shard, batch_size=10, seed=0).next_batch()[0]
    assert torch.equal(again, seen[:10])  # seeded


def test_sampler_refuses_a_shard_smaller_than_a_batch():
    shard = load_shard(DataConfig("synthetic", num_shards=1000), 0)  # 2 samples
    with pytest.raises(ConfigError, match="fewer than a batch"):
        ShardSampler(shard, batch_size=10, seed=0)


def test_mnist_loads_from_torchvision_layout(mnist_root):
    images, labels = load_mnist(mnist_root)
    assert images.shape == (60000, 784) and images.dtype == torch.float32
    assert float(images.min()) == -1.0 and float(images.max()) == 1.0
    assert torch.bincount(labels).tolist() == [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]


def test_missing_mnist_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="MNIST not found"):
        load_mnist(str(tmp_path))
