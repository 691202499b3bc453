"""The allocator thresholds every training process sets (services/common/allocator.py): a step's
few-MB tensors come from the heap, and freed ones stay there for the next step."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

# In a fresh interpreter (the thresholds are per process and never undone): malloc and free an
# 8 MB block, as a step does with a gradient, and count the blocks glibc serves with mmap
# (mallinfo2's hblks) while it is held, and the heap's free top (keepcost) after it is freed.
PROBE = """
import ctypes, json, sys
from services.common import allocator
libc = ctypes.CDLL(None)
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = (ctypes.c_void_p,)
applied = allocator.keep_freed_memory() if sys.argv[1] == "tuned" else None
before = libc.mallinfo2().hblks
block = libc.malloc(8 << 20)
ctypes.memset(block, 1, 8 << 20)  # touched, as a tensor is
mapped = libc.mallinfo2().hblks - before
libc.free(block)
print(json.dumps({"applied": applied, "mapped": mapped, "kept_free": libc.mallinfo2().keepcost}))
"""

glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                           reason="mallopt and mallinfo2 are glibc's")


def _probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True, timeout=60)
    return json.loads(out.stdout)


@glibc
def test_a_freed_step_sized_block_stays_in_the_heap():
    default, tuned = _probe("default"), _probe("tuned")
    # glibc's defaults: an 8 MB block is mmapped, and its pages are given back when it is freed.
    assert default["mapped"] == 1
    assert tuned["applied"] is True
    assert tuned["mapped"] == 0  # from the heap
    assert tuned["kept_free"] >= 8 << 20  # and still there for the next step


def test_without_mallopt_the_defaults_stay_and_nothing_raises(monkeypatch):
    import ctypes

    from services.common import allocator

    class Musl:  # a C library with no mallopt (musl, macOS)
        pass

    monkeypatch.setattr(ctypes, "CDLL", lambda name: Musl())
    assert allocator.keep_freed_memory() is False

    def missing(name):
        raise OSError("no C library")

    monkeypatch.setattr(ctypes, "CDLL", missing)
    assert allocator.keep_freed_memory() is False


def test_a_refused_threshold_is_reported(monkeypatch, caplog):
    import ctypes

    from services.common import allocator

    class Refusing:
        def __init__(self):
            self.mallopt = lambda parameter, value: 0  # glibc's answer to a value out of range

    monkeypatch.setattr(ctypes, "CDLL", lambda name: Refusing())
    assert allocator.keep_freed_memory() is False
    assert "refused" in caplog.text
