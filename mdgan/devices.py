"""Where a process computes, and what makes CUDA's arithmetic repeatable.

On CUDA the same run on the same card gives the same generator, and `mdgan local` the same as
`mdgan simulate`, bit for bit, only with deterministic kernels: cuBLAS with a fixed workspace
(CUBLAS_WORKSPACE_CONFIG, read when cuBLAS starts), cuDNN without benchmarking, and PyTorch's
deterministic implementations (an embedding's backward, a transposed convolution's) where the
default ones accumulate with atomics in any order. docs/GPU.md says which ops stay
outside it."""

from __future__ import annotations

import os

CUBLAS_WORKSPACE = ":4096:8"  # cuBLAS's documented setting for reproducible results


def deterministic(device: str) -> None:
    """Once per process that computes on `device`, before its first CUDA kernel; nothing on a CPU.
    An op without a deterministic CUDA implementation warns (warn_only) instead of failing the run."""
    if device == "cpu":
        return
    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    # Nothing here reads memory it did not write, so filling every new tensor (a kernel each) buys nothing.
    torch.utils.deterministic.fill_uninitialized_memory = False


def resolve(device: str):
    """The torch device a process's networks live on, with its index: `cuda` is cuda:N for the current device N, so
    it compares equal to the device of every tensor made there (a tensor's device always has its index)."""
    import torch

    found = torch.device(device)
    if found.type == "cuda" and found.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return found


def to_device(tensor, device):
    """`tensor` on `device` (itself when it is there; `device` as resolve() gives it). From the CPU to CUDA through
    pinned memory, without waiting for the GPU: a plain copy from pageable memory synchronises the host with every
    kernel queued before it."""
    if tensor.device == device:
        return tensor
    if tensor.device.type == "cpu" and device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
