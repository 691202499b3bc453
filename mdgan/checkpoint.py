"""Durable state: the on-disk format of checkpoints, atomic writes, and which checkpoint is complete.

Layout of a checkpoint directory (the server's OUT/checkpoints, or a worker's STATE_DIR/RUN_ID):

    000000800/server.pt        one file per member that saved at iteration 800 (torch.save of tensors,
    000000800/COMPLETE         dicts, numbers and strings only: read back with weights_only=True)
    000000900/server.pt        ... a later checkpoint still being gathered, or never completed

A checkpoint counts only once its COMPLETE marker exists (the server writes it after its own
file and every live worker's acknowledgement); resume starts from the newest complete one. Every
file is written to a temporary name, fsynced, then renamed over the final name and the directory
fsynced, so a crash at any moment leaves either the old file or the new one, never half of one.
Only files this program wrote are ever loaded; bytes from the network never go through torch.load.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pickle
import re
import shutil
import tempfile

import torch

COMPLETE = "COMPLETE"
RUN_FILE = "run_identity.json"  # a run directory's identity: {"run_id", "config", ...}
# A worker's state dir keeps the discriminator it held at each finished run's end (the newest few),
# for the site's own audit: STATE/finished/RUN/discriminator.pt
FINISHED_DIR = "finished"
FINAL_DISCRIMINATOR_FILE = "discriminator.pt"
FINISHED_KEPT = 5
_ITERATION_DIR = re.compile(r"^\d{9}$")


class CheckpointError(Exception):
    """A checkpoint is missing, unreadable, or belongs to another run."""


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # platforms without directory fds: the rename is still atomic
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def naming(path: str):
    """An OSError raised inside with no file name (a failed write says only "No space left on
    device") comes out with `path` as its file name."""
    try:
        yield
    except OSError as exc:
        if exc.filename is not None:
            raise
        raise OSError(exc.errno, exc.strerror or str(exc), path) from None


def _atomic_write(path: str, write) -> None:
    """write(fh) into a temporary file next to `path`, fsync it, rename it over `path`."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        with naming(path), os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    _fsync_dir(folder)


def _torch_save(obj, fh) -> None:
    try:
        torch.save(obj, fh)
    except RuntimeError as exc:
        # A write that failed (a full disk, a quota) ends in torch's own RuntimeError ("unexpected
        # pos ..."), the OSError as its context: the OSError is what happened, and what callers expect.
        if isinstance(exc.__context__, OSError):
            raise exc.__context__ from None
        raise


def atomic_save(obj, path: str) -> None:
    """torch.save, atomically."""
    _atomic_write(path, lambda fh: _torch_save(obj, fh))


def atomic_write_bytes(path: str, data: bytes) -> None:
    _atomic_write(path, lambda fh: fh.write(data))


def atomic_write_json(path: str, obj) -> None:
    _atomic_write(path, lambda fh: fh.write((json.dumps(obj, indent=2) + "\n").encode()))


def read_json(path: str):
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def load(path: str):
    """A checkpoint file written by this program (tensors and plain data only)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such checkpoint file") from None
    except Exception as exc:  # truncated, damaged or not ours: which file, and torch's first words
        said = " ".join(str(exc).split())
        if isinstance(exc, pickle.UnpicklingError):  # (torch's words there advise loading it unsafely: not said)
            said = ""
        detail = f"{type(exc).__name__}: {said[:150] + '...' if len(said) > 150 else said}" if said else \
            type(exc).__name__
        raise CheckpointError(f"{path}: unreadable checkpoint, truncated or not written by mdgan ({detail})") from None


def read_identity(out_dir: str) -> dict:
    """A run directory's identity ({"run_id", "config", ...}); CheckpointError, in one line, when it is not one."""
    path = os.path.join(out_dir, RUN_FILE)
    try:
        identity = read_json(path)
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{path}: not a run's identity (not JSON: {exc})") from None
    if not (isinstance(identity, dict) and isinstance(identity.get("run_id"), str)
            and isinstance(identity.get("config"), dict)):
        raise CheckpointError(f"{path}: not a run's identity (no run_id and config)")
    from mdgan.config import TrainingConfig

    try:  # (on the CPU: the device is each process's own, and a run resumes on another machine's)
        dataclasses.replace(TrainingConfig.from_dict(identity["config"]), device="cpu").validate()
        if not all(type(identity["config"][key]) is int for key in ("workers", "iterations")):
            raise TypeError("workers and iterations must be whole numbers")
    except (KeyError, TypeError, ValueError) as exc:  # (ConfigError is a ValueError)
        raise CheckpointError(f"{path}: not a run's identity (its config: {type(exc).__name__}: {exc})") from None
    return identity


class CheckpointStore:
    """Checkpoints of one member under `root`, one folder per iteration; the newest `keep` are kept."""

    def __init__(self, root: str, keep: int = 3):
        if keep < 1:
            raise CheckpointError("--keep-checkpoints must be at least 1")
        self.root = root
        self.keep = keep

    def folder(self, iteration: int) -> str:
        return os.path.join(self.root, f"{iteration:09d}")

    def iterations(self) -> list[int]:
        """Iterations that have a folder (complete or not), oldest first."""
        if not os.path.isdir(self.root):
            return []
        return sorted(int(name) for name in os.listdir(self.root)
                      if _ITERATION_DIR.match(name) and os.path.isdir(os.path.join(self.root, name)))

    def holding(self, name: str) -> list[int]:
        """Iterations for which member `name` wrote its file, oldest first."""
        return [i for i in self.iterations() if os.path.exists(os.path.join(self.folder(i), f"{name}.pt"))]

    def save(self, iteration: int, name: str, state: dict) -> str:
        path = os.path.join(self.folder(iteration), f"{name}.pt")
        atomic_save(state, path)
        return path

    def load(self, iteration: int, name: str) -> dict:
        return load(os.path.join(self.folder(iteration), f"{name}.pt"))

    def mark_complete(self, iteration: int, info: dict) -> None:
        atomic_write_json(os.path.join(self.folder(iteration), COMPLETE), {"iteration": iteration, **info})
        self.prune()

    def complete(self) -> list[int]:
        return [i for i in self.iterations() if os.path.exists(os.path.join(self.folder(i), COMPLETE))]

    def latest_complete(self) -> int | None:
        done = self.complete()
        return done[-1] if done else None

    def info(self, iteration: int) -> dict:
        return read_json(os.path.join(self.folder(iteration), COMPLETE))

    def prune(self, marker: str | None = COMPLETE) -> None:
        """Keep the newest `keep` checkpoints that count (complete ones; or, marker None, any that hold
        a file) and drop everything older than the oldest of those, incomplete ones included."""
        counted = self.complete() if marker else self.iterations()
        if len(counted) <= self.keep:
            return
        oldest_kept = counted[-self.keep]
        for iteration in self.iterations():
            if iteration < oldest_kept:
                shutil.rmtree(self.folder(iteration), ignore_errors=True)


def truncate_jsonl(path: str, keep) -> int:
    """Rewrite a .jsonl file keeping the complete lines for which keep(record) is true (atomically);
    returns how many were kept. Resume uses it so history continues with no gap and no duplicate."""
    if not os.path.exists(path):
        return 0
    kept = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if not line.endswith("\n"):  # half a line written when the process died
                break
            try:
                record = json.loads(line)
            except ValueError:
                break
            if keep(record):
                kept.append(line)
    _atomic_write(path, lambda fh: fh.write("".join(kept).encode()))
    return len(kept)
