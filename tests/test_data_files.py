"""Dataset files are checked as they are read: a damaged file is one clear error naming it."""

from __future__ import annotations

import gzip
import os
import pickle

import numpy as np
import pytest
import torch

from mdgan.config import DataConfig
from mdgan.data import DataFileError, load_cifar10, load_mnist, load_shard, read_idx_ubyte
from test_shards import write_fake_cifar10


def idx(magic: int, dims: tuple[int, ...], body: bytes) -> bytes:
    return magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in dims) + body


def write_mnist(root, images: bytes, labels: bytes) -> str:
    raw = os.path.join(root, "MNIST", "raw")
    os.makedirs(raw, exist_ok=True)
    for name, content in (("train-images-idx3-ubyte", images), ("train-labels-idx1-ubyte", labels)):
        with open(os.path.join(raw, name), "wb") as fh:
            fh.write(content)
    return raw


def test_a_small_valid_mnist_loads(tmp_path):
    pixels = np.arange(5 * 784, dtype=np.uint8).tobytes()
    write_mnist(tmp_path, idx(0x803, (5, 28, 28), pixels), idx(0x801, (5,), bytes([0, 1, 2, 3, 9])))
    images, labels = load_mnist(str(tmp_path))
    assert images.shape == (5, 784) and labels.tolist() == [0, 1, 2, 3, 9]
    assert torch.equal(images, torch.frombuffer(bytearray(pixels), dtype=torch.uint8).view(5, 784).float() / 127.5 - 1)


@pytest.mark.parametrize("images,labels,message", [
    (idx(0x803, (60000, 28, 28), bytes(984)), idx(0x801, (60000,), bytes(60000)), "images-idx3-ubyte: truncated"),
    (idx(0x803, (2, 28, 28), bytes(2 * 784 + 7)), idx(0x801, (2,), bytes(2)), "longer than its header"),
    (idx(0x1f8b0808, (2, 28, 28), bytes(2 * 784)), idx(0x801, (2,), bytes(2)), "images-idx3-ubyte: a damaged gzip"),
    (idx(0x0a0b0808, (2, 28, 28), bytes(2 * 784)), idx(0x801, (2,), bytes(2)), "magic number 0x0a0b0808"),
    (idx(0x801, (2, 28, 28), bytes(2 * 784)), idx(0x801, (2,), bytes(2)), "images-idx3-ubyte: not an IDX file"),
    (idx(0x803, (2, 28, 28), bytes(2 * 784)), idx(0x801, (3,), bytes(3)), "3 labels for the 2 images"),
    (idx(0x803, (2, 28, 28), bytes(2 * 784)), idx(0x801, (2,), bytes([1, 12])), "label 12 is not a digit"),
    (idx(0x803, (2, 14, 14), bytes(2 * 196)), idx(0x801, (2,), bytes(2)), "not MNIST's 28 x 28"),
    (b"\0\0\x08", idx(0x801, (2,), bytes(2)), "too short"),
    (idx(0x803, (2,), b""), idx(0x801, (2,), bytes(2)), "truncated inside its header"),
])
def test_a_damaged_mnist_file_is_one_clear_error_naming_it(tmp_path, images, labels, message):
    raw = write_mnist(tmp_path, images, labels)
    with pytest.raises(DataFileError, match=message) as error:
        load_mnist(str(tmp_path))
    assert raw in str(error.value)
    with pytest.raises(DataFileError):  # a worker's shard goes through the same checks
        load_shard(DataConfig("mnist", str(tmp_path), num_shards=2), 0)


def test_a_missing_mnist_file_is_named(tmp_path):
    raw = write_mnist(tmp_path, idx(0x803, (2, 28, 28), bytes(2 * 784)), b"")
    os.remove(os.path.join(raw, "train-labels-idx1-ubyte"))
    with pytest.raises(DataFileError, match=r"train-labels-idx1-ubyte: no such file \(nor train-labels-idx1-ubyte.gz\)"):
        load_mnist(str(tmp_path))
    with pytest.raises(DataFileError, match="not an IDX file"):
        read_idx_ubyte(os.path.join(raw, "train-images-idx3-ubyte"), 1)  # right file, wrong rank


def test_gzip_compressed_mnist_loads_as_the_uncompressed_files_do(tmp_path, mnist_root):
    """MNIST as distributed (*.gz beside nothing else), and a compressed file under the plain name."""
    raw = os.path.join(tmp_path, "MNIST", "raw")
    os.makedirs(raw)
    for name in ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        with open(os.path.join(mnist_root, "MNIST", "raw", name), "rb") as src:
            content = src.read()
        target = name + ".gz" if name.startswith("t10k-images") else name  # the labels: gzip under the plain name
        with gzip.open(os.path.join(raw, target), "wb") as dst:
            dst.write(content)
    images, labels = load_mnist(str(tmp_path), train=False)
    expected_images, expected_labels = load_mnist(mnist_root, train=False)
    assert torch.equal(images, expected_images) and torch.equal(labels, expected_labels)
    assert images.shape == (10000, 784)


@pytest.mark.parametrize("damage,message", [
    (lambda z: z[:len(z) // 2], "images-idx3-ubyte.gz: a damaged gzip file"),  # cut inside the stream
    (lambda z: z[:10] + bytes(len(z) - 10), "images-idx3-ubyte.gz: a damaged gzip file"),  # corrupt body
    (lambda z: gzip.compress(idx(0x803, (100, 28, 28), np.random.default_rng(1).bytes(984))),
     "truncated: the header announces 100 x 28 x 28 bytes but the file holds 1000 once decompressed"),
    (lambda z: gzip.compress(idx(0x803, (2, 28, 28), bytes(2 * 784 + 1))), "longer than its header says"),
    (lambda z: gzip.compress(b"\0\0"), "images-idx3-ubyte.gz: 2 bytes once decompressed, too short"),
    (lambda z: gzip.compress(idx(0x801, (2, 28, 28), bytes(2 * 784))), "not an IDX file of 3-d unsigned bytes"),
    (lambda z: gzip.compress(idx(0x803, (2, 14, 14), bytes(2 * 196))), "images-idx3-ubyte.gz: images of 14 x 14"),
    # a forged header: refused before an array of 2^62 bytes is asked for
    (lambda z: gzip.compress(idx(0x803, (2 ** 31, 2 ** 31, 1), bytes(64))), "more than .* compressed bytes can hold"),
])
def test_a_damaged_gzip_mnist_file_is_one_clear_error_naming_it(tmp_path, damage, message):
    raw = write_mnist(tmp_path, b"", idx(0x801, (2,), bytes(2)))
    os.remove(os.path.join(raw, "train-images-idx3-ubyte"))
    pixels = np.random.default_rng(0).integers(0, 256, 2 * 784, dtype=np.uint8).tobytes()  # incompressible
    good = gzip.compress(idx(0x803, (2, 28, 28), pixels))
    with open(os.path.join(raw, "train-images-idx3-ubyte.gz"), "wb") as fh:
        fh.write(damage(good))
    with pytest.raises(DataFileError, match=message) as error:
        load_mnist(str(tmp_path))
    assert raw in str(error.value)


def test_mnist_reads_as_torchvision_does(mnist_root):
    from torchvision.datasets import MNIST

    reference = MNIST(root=mnist_root, train=False, download=False)
    images, labels = load_mnist(mnist_root, train=False)
    assert torch.equal(images, reference.data.reshape(-1, 784).float().div(127.5).sub(1.0))
    assert torch.equal(labels, reference.targets)


class _Planted:
    """Unpickles as a call of os.system: what a planted data file would do."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_a_cifar10_batch_that_would_run_code_is_refused_before_it_runs(tmp_path, protocol):
    write_fake_cifar10(tmp_path)
    marker = os.path.join(tmp_path, "planted-code-ran")
    path = os.path.join(tmp_path, "cifar-10-batches-py", "data_batch_3")
    with open(path, "wb") as fh:
        pickle.dump({"data": np.zeros((2, 3072), np.uint8), "labels": [0, 1], "x": _Planted(marker)}, fh,
                    protocol=protocol)
    with pytest.raises(DataFileError, match=r"data_batch_3: not a readable CIFAR-10 batch .*refused to load "
                                            r"(posix|os)\.system"):
        load_cifar10(str(tmp_path))
    assert not os.path.exists(marker)


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_cifar10_batches_pickled_with_any_protocol_load(tmp_path, protocol):
    raw, labels = write_fake_cifar10(tmp_path)
    path = os.path.join(tmp_path, "cifar-10-batches-py", "data_batch_1")
    with open(path, "rb") as fh:
        entry = pickle.load(fh)
    with open(path, "wb") as fh:
        pickle.dump(entry, fh, protocol=protocol)
    images, loaded = load_cifar10(str(tmp_path))
    assert loaded.tolist() == labels
    assert torch.equal(images, torch.from_numpy(raw).float().div(127.5).sub(1.0))


def test_missing_cifar10_beside_its_archive_says_to_extract_it(tmp_path):
    from mdgan.config import ConfigError

    with pytest.raises(ConfigError, match="CIFAR-10 not found") as error:
        load_cifar10(str(tmp_path))
    assert "extract" not in str(error.value)
    (tmp_path / "cifar-10-python.tar.gz").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"cifar-10-python.tar.gz is there: extract it with `tar -xzf "):
        load_cifar10(str(tmp_path))


def test_a_truncated_or_corrupt_cifar10_batch_is_one_clear_error_naming_it(tmp_path):
    write_fake_cifar10(tmp_path)
    path = os.path.join(tmp_path, "cifar-10-batches-py", "data_batch_2")
    with open(path, "rb") as fh:
        content = fh.read()
    for damaged in (content[: len(content) // 2], b"garbage" + content[7:], b""):
        with open(path, "wb") as fh:
            fh.write(damaged)
        with pytest.raises(DataFileError, match="data_batch_2: not a readable CIFAR-10 batch"):
            load_cifar10(str(tmp_path))
    with open(path, "wb") as fh:
        pickle.dump({"data": np.zeros((3, 3072), dtype=np.uint8), "labels": [0, 1]}, fh)
    with pytest.raises(DataFileError, match="data_batch_2: 2 labels for 3 images"):
        load_cifar10(str(tmp_path))


def test_the_cli_says_a_damaged_file_under_its_subcommand_without_a_usage_banner(tmp_path, capsys):
    from mdgan_app import cli

    write_mnist(tmp_path, idx(0x803, (60000, 28, 28), bytes(984)), idx(0x801, (60000,), bytes(60000)))
    code = cli.main(["simulate", "--workers", "2", "--iterations", "1", "--data-root", str(tmp_path),
                     "--out", str(tmp_path / "run"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("mdgan simulate: error: ") and "train-images-idx3-ubyte: truncated" in err
    assert "usage:" not in err and "Traceback" not in err
