"""Every conversion between torch tensors and the wire lives here.

Tensors travel as {shape, dtype, raw little-endian bytes}. Decoding never unpickles and checks
everything a peer could get wrong: dtype, shape, byte count, size bound, finiteness.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import warnings
from typing import Iterator

import numpy as np
import torch

from mdgan import compression
from services.common.proto import peer_pb2, tensor_pb2

if sys.byteorder != "little":  # raw bytes are little-endian on the wire
    raise ImportError("mdgan's wire codec supports little-endian hosts only")

CHUNK_BYTES = 1 << 20  # discriminator states stream in chunks of at most 1 MiB

_TO_WIRE = {
    torch.float32: tensor_pb2.DTYPE_FLOAT32,
    torch.float16: tensor_pb2.DTYPE_FLOAT16,
    torch.bfloat16: tensor_pb2.DTYPE_BFLOAT16,
    torch.float64: tensor_pb2.DTYPE_FLOAT64,
    torch.int64: tensor_pb2.DTYPE_INT64,
    torch.int32: tensor_pb2.DTYPE_INT32,
    torch.uint8: tensor_pb2.DTYPE_UINT8,
    torch.int8: tensor_pb2.DTYPE_INT8,  # quantised floats: the scales travel in Tensor.scales
}
_FROM_WIRE = {v: k for k, v in _TO_WIRE.items()}
_ELEMENT_BYTES = {dtype: torch.empty((), dtype=dtype).element_size() for dtype in _TO_WIRE}


class InvalidTensor(ValueError):
    """Input that fails validation. `reason` is short and stable (a metric label)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def _raw_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def encode_tensor(t: torch.Tensor) -> tensor_pb2.Tensor:
    if t.dtype not in _TO_WIRE:
        raise TypeError(f"dtype {t.dtype} cannot travel")
    return tensor_pb2.Tensor(shape=list(t.shape), dtype=_TO_WIRE[t.dtype], data=_raw_bytes(t))


# Tensors decoded from protobuf bytes view read-only memory, which we never write into: torch's
# warning about that says nothing here. Filtered once (a catch_warnings per message costs more
# than the decoding itself).
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or Inf in a float tensor. Through numpy where it can: a tenth of torch's cost on a
    batch-sized tensor (3 against 24 us for 10x784 float32), and every message pays it."""
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16
        return bool(torch.isfinite(t).all())
    return bool(np.isfinite(t.numpy()).all())


def _frombuffer(data: bytes | bytearray | memoryview, dtype: torch.dtype) -> torch.Tensor:
    if len(data) == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype)


def decode_tensor(msg: tensor_pb2.Tensor, *, shape: tuple[int, ...] | None = None,
                  dtype: torch.dtype | None = None, max_bytes: int | None = None,
                  finite: bool = True, field: str = "tensor") -> torch.Tensor:
    """Decode and validate. Raises InvalidTensor with reason dtype|shape|size|nonfinite."""
    if msg.dtype not in _FROM_WIRE:
        raise InvalidTensor("dtype", f"{field}: unknown dtype {msg.dtype}")
    got_dtype = _FROM_WIRE[msg.dtype]
    if dtype is not None and got_dtype != dtype:
        raise InvalidTensor("dtype", f"{field}: expected {dtype}, got {got_dtype}")
    if msg.scales and got_dtype != torch.int8:
        raise InvalidTensor("scales", f"{field}: a {got_dtype} tensor carries no scales")
    got_shape = tuple(msg.shape)
    if any(s < 0 for s in got_shape):
        raise InvalidTensor("shape", f"{field}: negative dimension in {got_shape}")
    expected_bytes = math.prod(got_shape) * _ELEMENT_BYTES[got_dtype]
    data = msg.data  # each access of a bytes field makes a new object: read it once
    if max_bytes is not None and max(expected_bytes, len(data)) > max_bytes:
        raise InvalidTensor("size", f"{field}: {max(expected_bytes, len(data))} bytes exceed the bound {max_bytes}")
    if shape is not None and got_shape != tuple(shape):
        raise InvalidTensor("shape", f"{field}: expected shape {tuple(shape)}, got {got_shape}")
    if len(data) != expected_bytes:
        raise InvalidTensor("size", f"{field}: shape {got_shape} needs {expected_bytes} bytes, got {len(data)}")
    t = _frombuffer(data, got_dtype).view(got_shape)
    if finite and t.is_floating_point() and not all_finite(t):
        raise InvalidTensor("nonfinite", f"{field}: contains NaN or Inf")
    return t


def encode_packed(packed: compression.Packed) -> tensor_pb2.Tensor:
    """A tensor in its wire form (mdgan/compression.py): values, and the int8 scales."""
    msg = encode_tensor(packed.values)
    if packed.scales is not None:
        msg.scales = _raw_bytes(packed.scales.to(torch.float32))
    return msg


def decode_packed(msg: tensor_pb2.Tensor, *, shape: tuple[int, ...], wire_dtype: str,
                  field: str = "tensor") -> torch.Tensor:
    """Decode a float tensor sent in the run's wire dtype, validate it, and unpack it to float32.

    Raises InvalidTensor (dtype|shape|size|nonfinite|scales). The dtype must be the run's: a peer
    cannot choose its own precision.
    """
    dtype = compression.TORCH_WIRE_DTYPES[wire_dtype]
    values = decode_tensor(msg, shape=shape, dtype=dtype, max_bytes=compression.packed_nbytes(shape, wire_dtype),
                           field=field)
    scales = None
    if dtype == torch.int8:
        count = compression.scale_count(tuple(shape))
        if len(msg.scales) != 4 * count:
            raise InvalidTensor("scales", f"{field}: {count} float32 scales need {4 * count} bytes, "
                                          f"got {len(msg.scales)}")
        scales = _frombuffer(msg.scales, torch.float32)
    try:
        return compression.unpack(compression.Packed(values, scales))
    except compression.PackingError as exc:
        raise InvalidTensor(exc.reason, f"{field}: {exc}") from None


class BatchEncoder:
    """The Batches message of each distinct (X_g, X_d) pair of an iteration, built once however many
    workers get it: with kappa = 1 all N workers get the same message, with kappa = k at most k
    distinct ones.

    A batch is known by the memory its tensors view (they are slices of the iteration's generated
    samples), not by the Python objects, which are new for every worker. The cache holds the
    batches it encoded, so that memory cannot be reused for another tensor while it is cached; it
    is emptied when the iteration changes.
    """

    def __init__(self) -> None:
        self._iteration: int | None = None
        self._messages: dict[tuple, tuple[object, object]] = {}

    @staticmethod
    def _key(t: torch.Tensor | None) -> tuple | None:
        return None if t is None else (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)

    def message(self, iteration: int, batch, wire_dtype: str):
        """A ServerMessage carrying `batch` (mdgan.gan.WorkerBatch); floats in the run's wire form
        (mdgan/compression.py), labels as they are. Shared: the caller must not modify it."""
        from services.common.proto import coordinator_pb2

        if iteration != self._iteration:
            self._iteration, self._messages = iteration, {}
        tensors = (batch.generated, batch.discriminated, batch.generated_labels, batch.discriminated_labels)
        key = (wire_dtype, *(self._key(t) for t in tensors))
        hit = self._messages.get(key)
        if hit is None:
            message = coordinator_pb2.ServerMessage(batches=coordinator_pb2.Batches(
                iteration=iteration,
                generated=encode_packed(compression.pack(batch.generated, wire_dtype)),
                discriminated=encode_packed(compression.pack(batch.discriminated, wire_dtype)),
                generated_labels=None if batch.generated_labels is None else encode_tensor(batch.generated_labels),
                discriminated_labels=None if batch.discriminated_labels is None
                else encode_tensor(batch.discriminated_labels)))
            hit = self._messages[key] = (tensors, message)  # holding the tensors pins the memory of the key
        return hit[1]


def decode_labels(msg: tensor_pb2.Tensor, count: int, num_classes: int, field: str) -> torch.Tensor:
    labels = decode_tensor(msg, shape=(count,), dtype=torch.int64, field=field)
    if count and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
        raise InvalidTensor("range", f"{field}: labels outside [0, {num_classes})")
    return labels


# ---------------------------------------------------------------------------------------------
# discriminator states: a header of tensor specs, then the concatenated raw bytes in chunks


def _state_views(state: dict[str, torch.Tensor]) -> tuple[list[tensor_pb2.TensorSpec], list[memoryview]]:
    """The specs of a state's tensors, and each non-empty one's bytes as a view (no copy)."""
    specs, views = [], []
    for name, t in state.items():
        specs.append(tensor_pb2.TensorSpec(name=name, shape=list(t.shape), dtype=_TO_WIRE[t.dtype]))
        if t.numel():
            views.append(memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))
    return specs, views


def _state_blob(state: dict[str, torch.Tensor]) -> tuple[list[tensor_pb2.TensorSpec], memoryview]:
    """The specs of a state's tensors and their bytes, concatenated in one copy (a swap moves
    megabytes: each pass over them is measurable, docs/PERFORMANCE.md, "What a swap costs")."""
    specs, views = _state_views(state)
    return specs, memoryview(b"".join(views))


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


# A data chunk's field key, from an empty one (a oneof member is written even when empty: the key,
# then a zero length).
_DATA_CHUNK_KEY = peer_pb2.DiscriminatorChunk(data=b"").SerializeToString()[:-1]


def wire_state_chunks(state: dict[str, torch.Tensor], swap_round: int, sender: str, sender_identity: str = "",
                      copy: bool = False, chunk_bytes: int = CHUNK_BYTES) -> list[tuple[bytes, int]]:
    """What state_chunks yields, serialized: (the chunk's wire bytes, its payload bytes) for the
    header, then for each chunk of data.

    A swap moves megabytes, and every pass over them shows (docs/PERFORMANCE.md, "What a swap costs"):
    a data chunk is written straight from the tensors' memory (its key, its length, its bytes) in
    one copy, where building the message, serializing it (gRPC) and measuring it (ByteSize, which
    upb does by serializing) made three more. Parsing each with DiscriminatorChunk.FromString gives
    state_chunks' messages (tests/test_codec.py)."""
    specs, views = _state_views(state)
    total = sum(len(view) for view in views)
    header = peer_pb2.DiscriminatorChunk(header=peer_pb2.DiscriminatorHeader(
        round=swap_round, sender_worker=sender, tensors=specs, total_bytes=total,
        sender_identity=sender_identity, copy=copy))
    out = [(header.SerializeToString(), 0)]
    pieces, filled = [], 0  # the current chunk's slices of the tensors' bytes
    for view in views:
        offset = 0
        while offset < len(view):
            take = min(chunk_bytes - filled, len(view) - offset)
            pieces.append(view[offset:offset + take])
            offset += take
            filled += take
            if filled == chunk_bytes:
                out.append((b"".join((_DATA_CHUNK_KEY, _varint(filled), *pieces)), filled))
                pieces, filled = [], 0
    if filled:
        out.append((b"".join((_DATA_CHUNK_KEY, _varint(filled), *pieces)), filled))
    return out


def data_chunk_bytes(data_bytes: int) -> int:
    """The serialized size of a DiscriminatorChunk carrying `data_bytes` bytes of data, without
    serializing it (ByteSize() would: upb measures by serializing)."""
    return len(_DATA_CHUNK_KEY) + len(_varint(data_bytes)) + data_bytes


def state_chunks(state: dict[str, torch.Tensor], swap_round: int, sender: str, sender_identity: str = "",
                 chunk_bytes: int = CHUNK_BYTES) -> Iterator[peer_pb2.DiscriminatorChunk]:
    """A discriminator for the Peer swap: its header, then its bytes in chunks."""
    specs, payload = _state_blob(state)
    yield peer_pb2.DiscriminatorChunk(header=peer_pb2.DiscriminatorHeader(
        round=swap_round, sender_worker=sender, tensors=specs, total_bytes=len(payload),
        sender_identity=sender_identity))
    for start in range(0, len(payload), chunk_bytes):
        yield peer_pb2.DiscriminatorChunk(data=bytes(payload[start:start + chunk_bytes]))


def model_parts(state: dict[str, torch.Tensor], round_: int, model: str,
                chunk_bytes: int = CHUNK_BYTES) -> Iterator["coordinator_pb2.ModelPart"]:
    """An FL-GAN model state on the Train stream: its header, then its bytes in chunks."""
    from services.common.proto import coordinator_pb2

    specs, payload = _state_blob(state)
    yield coordinator_pb2.ModelPart(round=round_, model=model,
                                    header=tensor_pb2.StateHeader(tensors=specs, total_bytes=len(payload)))
    for start in range(0, len(payload), chunk_bytes):
        yield coordinator_pb2.ModelPart(round=round_, model=model, data=bytes(payload[start:start + chunk_bytes]))


def replica_parts(state: dict[str, torch.Tensor], iteration: int, round_: int, model: str, content: str,
                  chunk_bytes: int = CHUNK_BYTES) -> Iterator["psgan_pb2.ReplicaPart"]:
    """A parameter-server GAN's weights, gradients or buffers on the Train stream: the header, then the
    bytes in chunks (StateAssembler puts them back together)."""
    from services.common.proto import psgan_pb2

    specs, payload = _state_blob(state)
    where = dict(iteration=iteration, round=round_, model=model, content=content)
    yield psgan_pb2.ReplicaPart(**where, header=tensor_pb2.StateHeader(tensors=specs, total_bytes=len(payload)))
    for start in range(0, len(payload), chunk_bytes):
        yield psgan_pb2.ReplicaPart(**where, data=bytes(payload[start:start + chunk_bytes]))


def layout_of(state: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {name: (tuple(t.shape), t.dtype) for name, t in state.items()}


class StateAssembler:
    """Receives a streamed discriminator state, checked against the layout the receiver expects.

    The header is validated before any byte is buffered, so a peer cannot make us allocate more
    than our own discriminator's size.
    """

    def __init__(self, layout: dict[str, tuple[tuple[int, ...], torch.dtype]]):
        self.layout = layout
        self.header: peer_pb2.DiscriminatorHeader | None = None
        self._buffer: bytearray | None = None
        self._filled = 0

    def expected_bytes(self) -> int:
        return sum(math.prod(shape) * _ELEMENT_BYTES[dt] for shape, dt in self.layout.values())

    def accept_header(self, header) -> None:  # DiscriminatorHeader or StateHeader
        if self.header is not None:
            raise InvalidTensor("protocol", "second header in one stream")
        names = [s.name for s in header.tensors]
        if sorted(names) != sorted(self.layout) or len(set(names)) != len(names):
            raise InvalidTensor("layout", f"state tensors {sorted(names)} do not match {sorted(self.layout)}")
        for spec in header.tensors:
            shape, dtype = self.layout[spec.name]
            if tuple(spec.shape) != shape or _FROM_WIRE.get(spec.dtype) != dtype:
                raise InvalidTensor("shape", f"{spec.name}: expected {shape} {dtype}, got {tuple(spec.shape)} "
                                             f"{_FROM_WIRE.get(spec.dtype)}")
        if header.total_bytes != self.expected_bytes():
            raise InvalidTensor("size", f"state announces {header.total_bytes} bytes, expected {self.expected_bytes()}")
        self.header = header
        self._buffer = bytearray(header.total_bytes)

    def accept_data(self, data: bytes) -> None:
        if self.header is None or self._buffer is None:
            raise InvalidTensor("protocol", "data before header")
        if len(data) > CHUNK_BYTES:
            raise InvalidTensor("size", f"chunk of {len(data)} bytes exceeds {CHUNK_BYTES}")
        end = self._filled + len(data)
        if end > len(self._buffer):
            raise InvalidTensor("size", "more bytes than the header announced")
        self._buffer[self._filled:end] = data
        self._filled = end

    def accept(self, chunk) -> None:
        """A DiscriminatorChunk or a ModelPart: a header, or raw bytes."""
        kind = chunk.WhichOneof("body")
        if kind == "header":
            self.accept_header(chunk.header)
        elif kind == "data":
            self.accept_data(chunk.data)
        else:
            raise InvalidTensor("protocol", "empty chunk")

    def finish(self) -> dict[str, torch.Tensor]:
        if self.header is None or self._buffer is None:
            raise InvalidTensor("protocol", "stream ended before a header")
        if self._filled != len(self._buffer):
            raise InvalidTensor("size", f"stream ended after {self._filled} of {len(self._buffer)} bytes")
        state, offset = {}, 0
        for spec in self.header.tensors:
            shape, dtype = self.layout[spec.name]
            size = math.prod(shape) * _ELEMENT_BYTES[dtype]
            t = torch.frombuffer(self._buffer, dtype=dtype, count=math.prod(shape), offset=offset).view(shape) \
                if size else torch.empty(shape, dtype=dtype)
            if t.is_floating_point() and not all_finite(t):
                raise InvalidTensor("nonfinite", f"{spec.name}: contains NaN or Inf")
            state[spec.name] = t
            offset += size
        return state


# ---------------------------------------------------------------------------------------------
# an algorithm's options <-> its message in the TrainingSpec (the rest: services/common/training_spec.py)


def describe_options(spec, algorithm: str, options) -> None:
    """An algorithm's options into the spec's message of its own (spec.<algorithm>), field for field;
    an option that is None is left unset."""
    message = getattr(spec, algorithm)
    message.SetInParent()
    for field in dataclasses.fields(options):
        value = getattr(options, field.name)
        if value is not None:
            setattr(message, field.name, value)


def options_from_spec(spec, algorithm: str, **overrides):
    """The worker's view of an algorithm's options: what the spec's message sets, the defaults for the
    rest (a spec without the message: all of them), `overrides` (not None) over both; validated
    (raises mdgan.config.ConfigError on nonsense, e.g. T = 0)."""
    from mdgan import algorithms

    entry = algorithms.get(algorithm)
    given = {}
    if spec.WhichOneof("options") == algorithm:
        message = getattr(spec, algorithm)
        given = {f.name: getattr(message, f.name) for f in entry.option_fields() if message.HasField(f.name)}
    options = entry.options(**{**given, **{k: v for k, v in overrides.items() if v is not None}})
    return options.validate() if hasattr(options, "validate") else options
