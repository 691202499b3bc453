"""Datasets and shards. A worker loads the dataset, keeps its own shard and never sends a sample.

Images are float32 in [-1, 1] (the range of G's tanh), stored flat: (N, d) with d = 784 for MNIST
and d = 3072 for CIFAR-10 (channel-first, (C, H, W) flattened); labels are (N,) int64.

Shards: "iid" (the paper's setting) cuts a seeded permutation into equal pieces; "dirichlet"
gives non-i.i.d. shards (see dirichlet_shard_indices). Both are seeded by the split seed, so every
worker computes the same split from the same dataset.
"""

from __future__ import annotations

import gzip
import math
import os
import pickle
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from mdgan.config import ConfigError, DataConfig, named
from mdgan.devices import to_device
from mdgan.images import find_images, load_imagefolder

SYNTHETIC_SIZE = 2000
SYNTHETIC_SEED = 1234  # fixed: every worker must build the same synthetic dataset

# The flat sample shape of each dataset (ModelSpec.sample_shape).
DATASET_SAMPLE_SHAPES: dict[str, tuple[int, ...]] = {"mnist": (784,), "cifar10": (3072,), "synthetic": (784,)}

CIFAR10_FOLDER = "cifar-10-batches-py"  # torchvision's layout, as extracted from CIFAR10_ARCHIVE
CIFAR10_ARCHIVE = "cifar-10-python.tar.gz"
CIFAR10_TRAIN_FILES = ("data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5")
CIFAR10_TEST_FILES = ("test_batch",)

# Dirichlet shards hold at least min(DIRICHLET_MIN_SHARD, N // num_shards) samples: a batch of the
# paper's largest b (100), or the i.i.d. share when the dataset is too small for that.
DIRICHLET_MIN_SHARD = 100
DIRICHLET_TRIES = 100  # draws before the last one is rebalanced


@dataclass(frozen=True)
class Shard:
    images: torch.Tensor  # (m, *sample_shape) float32 in [-1, 1]
    labels: torch.Tensor  # (m,) int64
    index: int
    num_shards: int

    def __len__(self) -> int:
        return self.images.shape[0]


class DataFileError(ConfigError):
    """A dataset file that is missing, truncated or not what it claims to be (the message names it)."""


# IDX (LeCun's MNIST format): a big-endian magic number 0x0000TTDD (TT the element type, DD the
# number of dimensions), DD big-endian uint32 sizes, then the elements.
IDX_UBYTE = 0x08
MNIST_FILES = {True: ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
               False: ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}


GZIP_MAGIC = b"\x1f\x8b"
READ_CHUNK = 1 << 20
DEFLATE_MAX_RATIO = 1032  # deflate's largest expansion: 258 bytes from about 2 bits


def idx_file(path: str) -> str:
    """`path`, or `path`.gz when only the compressed file is there (MNIST as distributed)."""
    return path + ".gz" if not os.path.exists(path) and os.path.exists(path + ".gz") else path


def read_idx_ubyte(path: str, dims: int) -> np.ndarray:
    """An IDX file of unsigned bytes with `dims` dimensions, checked against its own header.

    The file may be gzip-compressed: `path` itself, or `path`.gz (see idx_file). -> a writable
    uint8 array of the header's shape. Raises DataFileError naming the file when it is missing, is
    not IDX, has another type or rank, or holds more or fewer bytes than the header says.
    """
    path = idx_file(path)
    try:
        with open(path, "rb") as raw:
            compressed = raw.read(2) == GZIP_MAGIC
            raw.seek(0)
            size = os.fstat(raw.fileno()).st_size
            try:
                return _read_idx(path, gzip.GzipFile(fileobj=raw) if compressed else raw, dims, size, compressed)
            except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
                raise DataFileError(f"{path}: a damaged gzip file ({exc})") from None
    except FileNotFoundError:
        compressed_too = "" if path.endswith(".gz") else f" (nor {os.path.basename(path)}.gz)"
        raise DataFileError(f"{path}: no such file{compressed_too}") from None
    except OSError as exc:
        raise DataFileError(f"{path}: cannot be read: {exc.strerror or exc}") from None


def _read_idx(path: str, fh, dims: int, size: int, compressed: bool) -> np.ndarray:
    """The array of an IDX stream (`fh`, decompressing or not) of a file of `size` bytes on disk,
    read into the array a megabyte at a time (never the whole file twice in memory)."""
    shape, header_size = _idx_header(path, fh, dims, None if compressed else size)
    count = math.prod(shape)
    announced = f"the header announces {' x '.join(map(str, shape))} bytes"
    # The array is allocated only once the file can hold it: a plain file's size says whether the
    # body is all there, and deflate expands at most ~1032:1, so a forged header cannot exhaust the memory.
    if compressed and count > DEFLATE_MAX_RATIO * size:
        raise DataFileError(f"{path}: truncated: {announced}, more than {size} compressed bytes can hold")
    if not compressed and header_size + count != size:
        what = "truncated" if size < header_size + count else "longer than its header says"
        raise DataFileError(f"{path}: {what}: {announced} ({header_size + count} bytes with the header) but the "
                            f"file holds {size}")
    data = np.empty(count, dtype=np.uint8)
    view, got = memoryview(data), 0
    while got < count and (n := fh.readinto(view[got:got + READ_CHUNK])):
        got += n
    if got < count:
        raise DataFileError(f"{path}: truncated: {announced} but the file holds {header_size + got} once decompressed")
    if fh.read(1):
        raise DataFileError(f"{path}: longer than its header says (decompressed)")
    return data.reshape(shape)


def _idx_header(path: str, fh, dims: int, size: int | None) -> tuple[tuple[int, ...], int]:
    """The shape an IDX header announces, and the header's length. `size`: the file's, for the
    errors (None: a compressed file, whose decompressed size is not known up front)."""
    header = fh.read(4 + 4 * dims)
    held = f"{len(header)} bytes once decompressed" if size is None else f"{size} bytes"
    if len(header) < 4:
        raise DataFileError(f"{path}: {held}, too short for an IDX file")
    zeros, kind, rank = header[:2], header[2], header[3]
    if zeros != b"\0\0" or kind != IDX_UBYTE or rank != dims:
        raise DataFileError(f"{path}: not an IDX file of {dims}-d unsigned bytes (magic number "
                            f"0x{int.from_bytes(header[:4], 'big'):08x}, expected 0x{IDX_UBYTE << 8 | dims:08x})")
    if len(header) < 4 + 4 * dims:
        raise DataFileError(f"{path}: truncated inside its header ({held})")
    return tuple(int.from_bytes(header[4 + 4 * i:8 + 4 * i], "big") for i in range(dims)), len(header)


def _mnist_folder(data_root: str) -> str:
    """DATA_ROOT/MNIST/raw; ConfigError saying how to make one when it is not there."""
    raw = os.path.join(data_root, "MNIST", "raw")
    if not os.path.isdir(raw):
        raise ConfigError(
            f"MNIST not found under {raw!r}: point {named('data_root')} at a folder holding MNIST/raw "
            "(torchvision.datasets.MNIST(root, download=True) creates one)"
        )
    return raw


def load_mnist_uint8(data_root: str, train: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """MNIST as stored: images (n, 784) uint8, labels (n,) int64, from torchvision's layout
    (DATA_ROOT/MNIST/raw/*-idx*-ubyte, or the same names gzip-compressed, *.gz, as MNIST is
    distributed); never downloads. Every file is checked."""
    raw = _mnist_folder(data_root)
    image_file, label_file = (idx_file(os.path.join(raw, name)) for name in MNIST_FILES[train])  # or *.gz
    images = read_idx_ubyte(image_file, 3)  # (n, 28, 28)
    labels = read_idx_ubyte(label_file, 1)  # (n,)
    if images.shape[1:] != (28, 28):
        raise DataFileError(f"{image_file}: images of {images.shape[1]} x {images.shape[2]} pixels, not MNIST's 28 x 28")
    if labels.shape[0] != images.shape[0]:
        raise DataFileError(f"{label_file}: {labels.shape[0]} labels for the {images.shape[0]} images of {image_file}")
    if labels.size and int(labels.max()) > 9:
        raise DataFileError(f"{label_file}: label {int(labels.max())} is not a digit 0..9")
    return torch.from_numpy(images.reshape(-1, 28 * 28)), torch.from_numpy(labels).to(torch.int64)


def to_unit_range(images: torch.Tensor) -> torch.Tensor:
    """uint8 pixels -> float32 in [-1, 1] (the range of G's tanh); float images pass unchanged."""
    if images.dtype != torch.uint8:
        return images
    return images.to(torch.float32).div_(127.5).sub_(1.0)


def load_mnist(data_root: str, train: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """MNIST from torchvision's layout: images (n, 784) float32 in [-1, 1], labels (n,) int64."""
    images, labels = load_mnist_uint8(data_root, train)
    return to_unit_range(images), labels


class CifarBatchUnpickler(pickle.Unpickler):
    """Unpickles a CIFAR-10 batch and nothing else: dicts, lists, strings, numbers and numpy arrays.
    A pickle naming any other callable (os.system, say) is refused before it runs, so a planted data
    file cannot execute code in a worker."""

    ALLOWED = {("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"),
               ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer")}

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refused to load {module}.{name} (a CIFAR-10 batch holds only "
                                         "dicts, lists, strings, numbers and numpy arrays)")
        return super().find_class(module, name)


def _cifar10_folder(data_root: str, train: bool) -> str:
    """DATA_ROOT/cifar-10-batches-py; ConfigError naming the batch files missing there and how to make them."""
    folder = os.path.join(data_root, CIFAR10_FOLDER)
    names = CIFAR10_TRAIN_FILES if train else CIFAR10_TEST_FILES
    missing = [n for n in names if not os.path.isfile(os.path.join(folder, n))]
    if missing:
        archive = os.path.join(data_root, CIFAR10_ARCHIVE)
        hint = (f"; {archive} is there: extract it with `tar -xzf {archive} -C {data_root}`"
                if os.path.isfile(archive) else "")
        raise ConfigError(
            f"CIFAR-10 not found under {folder!r} (missing {', '.join(missing)}): point {named('data_root')} at a folder "
            f"holding {CIFAR10_FOLDER} (torchvision.datasets.CIFAR10(root, download=True) creates one){hint}"
        )
    return folder


def load_cifar10_uint8(data_root: str, train: bool = True,
                       verify_md5: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """CIFAR-10 as stored: images (n, 3072) uint8 channel-first, labels (n,) int64 (see load_cifar10)."""
    folder = _cifar10_folder(data_root, train)
    names = CIFAR10_TRAIN_FILES if train else CIFAR10_TEST_FILES
    if verify_md5:
        from torchvision.datasets import CIFAR10
        from torchvision.datasets.utils import check_integrity

        expected = dict(CIFAR10.train_list + CIFAR10.test_list)
        bad = [n for n in names if not check_integrity(os.path.join(folder, n), expected[n])]
        if bad:
            raise ConfigError(f"CIFAR-10 files under {folder!r} fail torchvision's md5 check: {', '.join(bad)}")
    chunks, targets = [], []
    for name in names:
        path = os.path.join(folder, name)
        try:
            with open(path, "rb") as fh:
                entry = CifarBatchUnpickler(fh, encoding="latin1").load()
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, ImportError,
                IndexError, KeyError, UnicodeDecodeError, MemoryError) as exc:
            # a truncated or corrupt file breaks the unpickler in many ways: one clear error for all
            raise DataFileError(f"{path}: not a readable CIFAR-10 batch (truncated or corrupt: "
                                f"{type(exc).__name__}: {exc})") from None
        except OSError as exc:
            raise DataFileError(f"{path}: cannot be read: {exc.strerror or exc}") from None
        data = np.asarray(entry.get("data")) if isinstance(entry, dict) else None
        labels = entry.get("labels", entry.get("fine_labels")) if isinstance(entry, dict) else None
        if data is None or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072 or labels is None:
            raise DataFileError(f"{path} is not a CIFAR-10 batch (a dict of 'data' uint8 (n, 3072) and n 'labels')")
        if len(labels) != data.shape[0]:
            raise DataFileError(f"{path}: {len(labels)} labels for {data.shape[0]} images")
        chunks.append(data)
        targets.extend(labels)
    try:
        labels = torch.tensor(targets, dtype=torch.int64)  # (n,)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        raise DataFileError(f"CIFAR-10 labels under {folder!r} are not integers") from None
    if labels.numel() and not (0 <= int(labels.min()) and int(labels.max()) < 10):
        raise DataFileError(f"CIFAR-10 labels under {folder!r} are not in 0..9")
    return torch.from_numpy(np.concatenate(chunks)), labels


def load_cifar10(data_root: str, train: bool = True, verify_md5: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """CIFAR-10 from torchvision's layout (DATA_ROOT/cifar-10-batches-py/); never downloads.

    -> images (n, 3072) float32 in [-1, 1], channel-first ((3, 32, 32) flattened: the red plane,
    then green, then blue), labels (n,) int64. The batches are read exactly as
    torchvision.datasets.CIFAR10 reads them (pickled dicts of "data" uint8 (n, 3072) and "labels")
    but without its md5 check of every file against the official archive, which only the official
    files pass; verify_md5=True runs that check (torchvision's checksums) and refuses other files.
    These are local files the user put there: nothing here unpickles bytes from the network, and the
    unpickler takes numpy arrays and plain containers only (CifarBatchUnpickler).
    """
    images, labels = load_cifar10_uint8(data_root, train, verify_md5)
    return to_unit_range(images), labels


def make_synthetic(size: int = SYNTHETIC_SIZE, dim: int = 784, num_classes: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """A small labelled dataset for smoke runs: one random prototype per class plus noise."""
    rng = torch.Generator().manual_seed(SYNTHETIC_SEED)
    prototypes = torch.rand(num_classes, dim, generator=rng) * 2 - 1  # (C, d)
    labels = torch.randint(0, num_classes, (size,), generator=rng)  # (size,)
    noise = 0.3 * torch.randn(size, dim, generator=rng)
    return (prototypes[labels] + noise).clamp_(-1, 1), labels


def check_stored_dataset(dataset: str, data_root: str) -> None:
    """ConfigError when `dataset`'s training data is not under data_root (what loading it would say first), found
    without reading it: a launcher refuses before it starts anything. Each file is checked as it is loaded."""
    if dataset == "mnist":
        _mnist_folder(data_root)
    elif dataset == "cifar10":
        _cifar10_folder(data_root, train=True)
    elif dataset == "imagefolder":
        find_images(data_root)


def load_stored_dataset(config: DataConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The dataset as stored (uint8 pixels for MNIST and CIFAR-10, 4x smaller than float32): cut the
    shard from this and convert only the shard (to_unit_range)."""
    config.validate()
    if config.dataset == "mnist":
        return load_mnist_uint8(config.data_root)
    if config.dataset == "cifar10":
        return load_cifar10_uint8(config.data_root)
    if config.dataset == "imagefolder":  # one folder of images, cut into shards like the others (emulation)
        site = load_imagefolder(config.data_root)
        return site.conform((math.prod(site.image_shape),)), site.labels
    return make_synthetic()


def load_dataset(config: DataConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole dataset: images (n, d) float32 in [-1, 1], labels (n,) int64."""
    images, labels = load_stored_dataset(config)
    return to_unit_range(images), labels


def iid_shard_indices(size: int, num_shards: int, seed: int) -> list[torch.Tensor]:
    """A seeded random permutation cut into num_shards contiguous pieces (sizes differ by <= 1)."""
    if num_shards > size:
        raise ConfigError(f"cannot split {size} samples into {num_shards} shards")
    order = torch.randperm(size, generator=torch.Generator().manual_seed(seed))
    return list(torch.tensor_split(order, num_shards))


def shard_sizes(size: int, num_shards: int) -> list[int]:
    """The sizes of the i.i.d. shards (the first size % num_shards shards hold one sample more).

    i.i.d. split only: Dirichlet shard sizes depend on the labels, so a server that assigns shards
    from this cannot assign Dirichlet shards; give every worker an explicit --shard-index then.
    """
    return [size // num_shards + (1 if i < size % num_shards else 0) for i in range(num_shards)]


def dirichlet_shard_indices(labels: torch.Tensor, num_shards: int, alpha: float, seed: int,
                            min_size: int | None = None) -> list[torch.Tensor]:
    """Non-i.i.d. shards: for each class, its samples are dealt to the shards in proportions ~ Dir(alpha).

    Small alpha (0.1) gives shards dominated by a few classes; large alpha (100) approaches i.i.d.
    Every shard gets at least min_size samples (default min(DIRICHLET_MIN_SHARD, N // num_shards),
    i.e. at least a batch of the paper's b <= 100 whenever the data allow it): the whole split is
    re-drawn up to DIRICHLET_TRIES times until it holds; if none does, the last draw is rebalanced:
    each short shard, in index order, takes random samples from the currently largest shard (lowest
    index on ties) without pushing that one below min_size. Seeded (numpy's PCG64 from seed); the
    indices of a shard come back sorted. -> num_shards disjoint int64 index tensors covering 0..N-1.
    """
    size = labels.shape[0]
    if num_shards > size:
        raise ConfigError(f"cannot split {size} samples into {num_shards} shards")
    if min_size is None:
        min_size = min(DIRICHLET_MIN_SHARD, size // num_shards)
    if min_size * num_shards > size:
        raise ConfigError(f"cannot give {num_shards} shards {min_size} samples each from {size} samples")
    rng = np.random.default_rng(seed)
    y = labels.detach().cpu().numpy()
    by_class = [np.flatnonzero(y == c) for c in np.unique(y)]
    for _ in range(DIRICHLET_TRIES):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_shards)]
        for members in by_class:
            members = rng.permutation(members)
            proportions = rng.dirichlet(np.full(num_shards, alpha))  # (num_shards,), sums to 1
            cuts = np.clip((np.cumsum(proportions)[:-1] * len(members)).astype(np.int64), 0, len(members))
            for shard, piece in zip(parts, np.split(members, cuts)):
                shard.append(piece)
        shards = [np.concatenate(p) for p in parts]
        if min(len(s) for s in shards) >= min_size:
            break
    else:
        shards = _rebalance(shards, min_size, rng)
    return [torch.from_numpy(np.sort(s)).to(torch.int64) for s in shards]


def _rebalance(shards: list[np.ndarray], min_size: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Top every shard up to min_size with random samples of the largest shard (see above)."""
    shards = list(shards)
    for i in range(len(shards)):
        while len(shards[i]) < min_size:
            donor = max(range(len(shards)), key=lambda j: (len(shards[j]), -j))
            take = min(min_size - len(shards[i]), len(shards[donor]) - min_size)  # >= 1: sum >= n*min_size
            moved = np.zeros(len(shards[donor]), dtype=bool)
            moved[rng.choice(len(shards[donor]), size=take, replace=False)] = True
            shards[i] = np.concatenate([shards[i], shards[donor][moved]])
            shards[donor] = shards[donor][~moved]
    return shards


def shard_indices(labels: torch.Tensor, config: DataConfig) -> list[torch.Tensor]:
    """The indices of every shard of the dataset, by config.split (seeded by config.split_seed); with
    config.max_samples, of a seeded choice of that many images only."""
    pool = None
    if config.max_samples and config.max_samples < labels.shape[0]:
        chooser = torch.Generator().manual_seed(config.split_seed + 7919)  # (not the split's own stream)
        pool = torch.randperm(labels.shape[0], generator=chooser)[:config.max_samples].sort().values
        labels = labels[pool]
    if config.split == "dirichlet":
        pieces = dirichlet_shard_indices(labels, config.num_shards, config.dirichlet_alpha, config.split_seed)
    else:
        pieces = iid_shard_indices(labels.shape[0], config.num_shards, config.split_seed)
    return pieces if pool is None else [pool[p] for p in pieces]


def _cut(images: torch.Tensor, labels: torch.Tensor, picked: torch.Tensor, index: int, config: DataConfig,
         sample_shape: tuple[int, ...] | None) -> Shard:
    shape = tuple(images.shape[1:]) if sample_shape is None else tuple(sample_shape)
    if math.prod(shape) != math.prod(images.shape[1:]):
        raise ConfigError(f"{config.dataset} samples have shape {tuple(images.shape[1:])}, which does not fit "
                          f"the model's sample shape {shape}")
    # Pick first, convert after: only the shard's samples become float32.
    return Shard(to_unit_range(images[picked]).reshape(-1, *shape).contiguous(), labels[picked].contiguous(),
                 index, config.num_shards)


def take_shard(images: torch.Tensor, labels: torch.Tensor, index: int, config: DataConfig,
               sample_shape: tuple[int, ...] | None = None) -> Shard:
    """Shard `index` of `config.num_shards` of an already loaded dataset (split by config.split).

    images may be float32 in [-1, 1] or stored uint8 pixels (converted here, the shard only).
    sample_shape None keeps the dataset's own flat shape (N, d).
    """
    if not 0 <= index < config.num_shards:
        raise ConfigError(f"shard index {index} out of range for {config.num_shards} shards")
    picked = shard_indices(labels, config.validate())[index]
    return _cut(images, labels, picked, index, config, sample_shape)


def load_shard(config: DataConfig, index: int, sample_shape: tuple[int, ...] | None = None) -> Shard:
    if not 0 <= index < config.validate().num_shards:  # before loading a whole dataset for nothing
        raise ConfigError(f"shard index {index} out of range for {config.num_shards} shards")
    images, labels = load_stored_dataset(config)
    return take_shard(images, labels, index, config, sample_shape)  # the rest is freed on return


def load_all_shards(config: DataConfig, sample_shape: tuple[int, ...] | None = None) -> list[Shard]:
    """Every shard at once (the in-process cluster), loading the dataset and splitting it a single time."""
    images, labels = load_stored_dataset(config.validate())
    pieces = shard_indices(labels, config)
    return [_cut(images, labels, picked, i, config, sample_shape) for i, picked in enumerate(pieces)]


class ShardSampler:
    """Draws batches of b real samples from a shard, epoch by epoch (a fresh permutation per epoch)."""

    def __init__(self, shard: Shard, batch_size: int, seed: int):
        if len(shard) < batch_size:
            raise ConfigError(f"shard {shard.index} has {len(shard)} samples, fewer than a batch of {batch_size}")
        self.shard = shard
        self.batch_size = batch_size
        self._rng = torch.Generator().manual_seed(seed)
        self._order = torch.randperm(len(shard), generator=self._rng)  # drawn on the CPU on every device
        self._position = 0
        self._order_where_images_are: torch.Tensor | None = None  # _order on the shard's device, once an epoch

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        # -> images (b, *sample_shape), labels (b,); the tail of an epoch shorter than b is skipped
        if self._position + self.batch_size > len(self.shard):
            self._order = torch.randperm(len(self.shard), generator=self._rng)
            self._order_where_images_are = None
            self._position = 0
        if self._order_where_images_are is None:
            self._order_where_images_are = to_device(self._order, self.shard.images.device)
        picked = self._order_where_images_are[self._position:self._position + self.batch_size]
        self._position += self.batch_size
        return self.shard.images[picked], self.shard.labels[picked]

    def state_dict(self) -> dict:
        """Where the sampler stands (RNG, this epoch's order, position): restoring it draws the same batches."""
        return {"rng": self._rng.get_state(), "order": self._order.clone(), "position": self._position}

    def load_state_dict(self, state: dict) -> None:
        if state["order"].shape != (len(self.shard),):
            raise ValueError(f"sampler state for a shard of {state['order'].shape[0]} samples, "
                             f"this shard has {len(self.shard)}")
        self._rng.set_state(state["rng"])
        self._order = state["order"].clone()
        self._order_where_images_are = None
        self._position = int(state["position"])
