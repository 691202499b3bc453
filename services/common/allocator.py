"""How a process asks glibc's malloc to keep the memory a training step frees.

Every step allocates and frees the same tensors: activations, gradients and the optimiser's
temporaries, the largest a few MB each (the MLP discriminator's first layer is 784x512 floats,
1.6 MB). glibc serves a block that large with mmap, or from the top of the heap and trims the heap
back once more than a few MB are free there, so the next step faults the same pages in again.
Serving blocks up to 16 MB from the heap and keeping up to 64 MB free at its top took a local
cluster at N=10 from about 1300 page faults per iteration to about 300 (the simulation: 260 to 6),
and its CPU per iteration down by about 3% (docs/PERFORMANCE.md). What it costs is at
most 64 MB of freed memory each process may keep.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger("mdgan.allocator")

# mallopt(3) parameters, from glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

TRIM_THRESHOLD_MB = 64
MMAP_THRESHOLD_MB = 16


def keep_freed_memory(trim_threshold_mb: int = TRIM_THRESHOLD_MB, mmap_threshold_mb: int = MMAP_THRESHOLD_MB) -> bool:
    """Set glibc's trim and mmap thresholds for this process. Returns whether they were set: False
    where the C library has no mallopt (musl, macOS) or refused a value; never raises."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        log.debug("no mallopt in this C library: the allocator keeps its defaults")
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success and 0 on error. The mmap threshold first: setting either one
    # also turns off glibc's own adjustment of both.
    applied = (mallopt(_M_MMAP_THRESHOLD, mmap_threshold_mb << 20) == 1
               and mallopt(_M_TRIM_THRESHOLD, trim_threshold_mb << 20) == 1)
    if not applied:
        log.warning("glibc refused the allocator thresholds (%d MB mmap, %d MB trim)", mmap_threshold_mb,
                    trim_threshold_mb)
    return applied
