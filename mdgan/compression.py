"""Wire compression: how generated batches, feedback and swapped discriminators are rounded.

The rounding is part of the algorithm, not of the transport: the sender packs a float32 tensor into
its wire form, the receiver unpacks it, and training goes on with the unpacked values. The gRPC
services send the packed form (services/common/codec.py turns it into bytes); the in-process
simulation packs and unpacks with these same functions at the same points, so `mdgan simulate` and
`mdgan local` still end with the same generator, bit for bit.

Wire dtypes:
- float32: nothing is rounded (the paper; the default).
- float16: values clamped to +-65504 first (no overflow to Inf), then rounded to half precision.
- bfloat16: float32's range, 8 bits of mantissa.
- int8: symmetric linear quantisation with one float32 scale per row (per sample of a batch, per
  output unit of a weight matrix; one per tensor for vectors and scalars):
  scale = max|row| / 127, q = round(x / scale) in [-127, 127], x' = q * scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mdgan.config import WIRE_DTYPES  # the one list of names, validated with the run's config

TORCH_WIRE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                     "int8": torch.int8}
INT8_LEVELS = 127  # symmetric: -127..127, so that 0 is exact and the range is the same on both sides
SCALE_SUFFIX = "#scale"  # a packed state carries each int8 tensor's scales under NAME#scale
_FLOAT16_MAX = torch.finfo(torch.float16).max


class PackingError(ValueError):
    """A packed tensor that cannot be unpacked (bad scales, wrong dtype or shape)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Packed:
    """A tensor in its wire form: `values` in the wire dtype, `scales` (float32) for int8 only."""

    values: torch.Tensor
    scales: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return _nbytes(self.values) + _nbytes(self.scales)


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def check_wire_dtype(wire_dtype: str) -> str:
    if wire_dtype not in WIRE_DTYPES:
        raise ValueError(f"unknown wire dtype {wire_dtype!r}; choose from {WIRE_DTYPES}")
    return wire_dtype


def scale_count(shape: tuple[int, ...]) -> int:
    """int8: one scale per row (the first dimension) for tensors of 2 or more dimensions, else one."""
    return shape[0] if len(shape) >= 2 else 1


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(scale_count(tuple(t.shape)), -1)  # (rows, elements per row)


def pack(t: torch.Tensor, wire_dtype: str) -> Packed:
    """The wire form of a float32 tensor."""
    t = t.detach()
    if t.dtype != torch.float32:
        raise TypeError(f"only float32 tensors are packed, got {t.dtype}")
    if wire_dtype == "float32":
        return Packed(t)
    if wire_dtype == "float16":
        return Packed(t.clamp(-_FLOAT16_MAX, _FLOAT16_MAX).to(torch.float16))
    if wire_dtype == "bfloat16":
        return Packed(t.to(torch.bfloat16))
    if wire_dtype == "int8":
        if t.numel() == 0:
            return Packed(torch.zeros(t.shape, dtype=torch.int8, device=t.device),
                          torch.zeros(scale_count(tuple(t.shape)), device=t.device))
        rows = _rows(t)
        scales = rows.abs().amax(dim=1) / INT8_LEVELS  # (rows,)
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero row stays zero
        q = torch.round(rows / safe[:, None]).clamp(-INT8_LEVELS, INT8_LEVELS).to(torch.int8)
        return Packed(q.view(t.shape), scales)
    raise ValueError(f"unknown wire dtype {wire_dtype!r}")


def unpack(packed: Packed) -> torch.Tensor:
    """The float32 tensor the receiver trains with. Raises PackingError on bad scales."""
    values, scales = packed.values, packed.scales
    if values.dtype == torch.int8:
        expected = scale_count(tuple(values.shape))
        if scales is None or scales.dtype != torch.float32 or tuple(scales.shape) != (expected,):
            raise PackingError("scales", f"an int8 tensor of shape {tuple(values.shape)} needs {expected} "
                                         f"float32 scales, got {None if scales is None else tuple(scales.shape)}")
        if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
            raise PackingError("scales", "int8 scales must be finite and >= 0")
    elif scales is not None:
        raise PackingError("scales", f"a {values.dtype} tensor carries no scales")
    elif values.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise PackingError("dtype", f"{values.dtype} is not a wire dtype")
    return _float32(packed)


def _float32(packed: Packed) -> torch.Tensor:
    """A packed tensor (checked, or our own) as float32, on its device."""
    values, scales = packed.values, packed.scales
    if values.dtype != torch.int8:
        return values.to(torch.float32)
    if values.numel() == 0:
        return torch.zeros(values.shape, device=values.device)
    return (_rows(values).to(torch.float32) * scales[:, None]).view(values.shape)


def round_trip(t: torch.Tensor, wire_dtype: str) -> torch.Tensor:
    """What the receiver of `t` gets: the same arithmetic as pack, send, unpack (our own packing needs no
    checks, so nothing is read back to the host)."""
    return t if wire_dtype == "float32" else _float32(pack(t, wire_dtype))


def packed_nbytes(shape: tuple[int, ...], wire_dtype: str) -> int:
    """Bytes a float32 tensor of this shape takes on the wire (values and scales)."""
    n = math.prod(shape)
    size = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}[wire_dtype]
    return n * size + (4 * scale_count(tuple(shape)) if wire_dtype == "int8" else 0)


# ---------------------------------------------------------------------------------------------
# model states (swapped discriminators): float32 tensors are packed, everything else travels as is.
# Adam's step counters (when the moments travel) are counts, not weights: kept exact at float32.

def _packs(name: str, t: torch.Tensor, wire_dtype: str) -> bool:
    return wire_dtype != "float32" and t.dtype == torch.float32 and not name.endswith(".step")


def pack_state(state: dict[str, torch.Tensor], wire_dtype: str) -> dict[str, torch.Tensor]:
    """A state as named tensors in wire form; an int8 tensor NAME carries its scales as NAME#scale."""
    out = {}
    for name, t in state.items():
        if not _packs(name, t, wire_dtype):
            out[name] = t
            continue
        p = pack(t, wire_dtype)
        out[name] = p.values
        if p.scales is not None:
            out[name + SCALE_SUFFIX] = p.scales
    return out


def unpack_state(packed: dict[str, torch.Tensor], layout: dict[str, tuple[tuple[int, ...], torch.dtype]],
                 wire_dtype: str) -> dict[str, torch.Tensor]:
    """The float32 state of a packed one whose tensors were checked against wire_layout(layout)."""
    out = {}
    for name, (shape, dtype) in layout.items():
        if not _packs(name, torch.empty(0, dtype=dtype), wire_dtype):
            out[name] = packed[name]
            continue
        out[name] = unpack(Packed(packed[name], packed.get(name + SCALE_SUFFIX)))
    return out


def wire_layout(layout: dict[str, tuple[tuple[int, ...], torch.dtype]],
                wire_dtype: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The names, shapes and dtypes a packed state of this layout has on the wire."""
    out = {}
    for name, (shape, dtype) in layout.items():
        if not _packs(name, torch.empty(0, dtype=dtype), wire_dtype):
            out[name] = (shape, dtype)
            continue
        out[name] = (shape, TORCH_WIRE_DTYPES[wire_dtype])
        if wire_dtype == "int8":
            out[name + SCALE_SUFFIX] = ((scale_count(shape),), torch.float32)
    return out


def state_round_trip(state: dict[str, torch.Tensor], wire_dtype: str) -> dict[str, torch.Tensor]:
    if wire_dtype == "float32":
        return state
    layout = {n: (tuple(t.shape), t.dtype) for n, t in state.items()}
    return unpack_state(pack_state(state, wire_dtype), layout, wire_dtype)


def state_nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(_nbytes(t) for t in state.values())
