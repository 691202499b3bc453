"""Where a process computes, and what makes CUDA's arithmetic repeatable.

On CUDA the same run on the same card gives the same generator, and `mdgan local` the same as
`mdgan simulate`, bit for bit, only with deterministic kernels: cuBLAS with a fixed workspace
(CUBLAS_WORKSPACE_CONFIG, read when cuBLAS starts), cuDNN without benchmarking, and PyTorch's
deterministic implementations (an embedding's backward, a transposed convolution's) where the
default ones accumulate with atomics in any order. docs/GUIDE.md ("On a GPU") says which ops stay
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


def same_device(a, b) -> bool:
    """Whether torch devices a and b are one device: `cuda` is the current CUDA device, as torch reads it."""
    if a.type != b.type:
        return False
    if a.index == b.index or a.type == "cpu":
        return True
    import torch

    current = torch.cuda.current_device() if a.type == "cuda" else 0
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)


def to_device(tensor, device):
    """`tensor` on `device` (itself when it is there). From the CPU to CUDA through pinned memory, without waiting for
    the GPU: a plain copy from pageable memory synchronises the host with every kernel queued before it."""
    if same_device(tensor.device, device):
        return tensor
    if tensor.device.type == "cpu" and device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
