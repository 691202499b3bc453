"""Wire compression: the rounding (mdgan/compression.py) and its wire form (services/common/codec.py)."""

import struct

import pytest
import torch

from mdgan import compression
from mdgan.config import ConfigError, ModelSpec, TrainingConfig
from mdgan.models import build_discriminator
from services.common import codec, training_spec
from services.common.proto import tensor_pb2

SHAPE = (10, 784)


def test_float32_is_untouched():
    x = torch.randn(SHAPE)
    assert compression.round_trip(x, "float32") is x
    assert compression.packed_nbytes(SHAPE, "float32") == 10 * 784 * 4


@pytest.mark.parametrize("wire, size, tol", [("float16", 2, 1e-3), ("bfloat16", 2, 8e-3)])
def test_half_precisions_take_half_the_bytes_and_round_once(wire, size, tol):
    x = torch.randn(SHAPE)
    packed = compression.pack(x, wire)
    assert packed.values.dtype == compression.TORCH_WIRE_DTYPES[wire] and packed.scales is None
    assert packed.nbytes == compression.packed_nbytes(SHAPE, wire) == 10 * 784 * size
    y = compression.unpack(packed)
    assert y.dtype == torch.float32 and torch.allclose(x, y, rtol=tol, atol=tol)
    assert torch.equal(compression.round_trip(y, wire), y)  # rounding twice changes nothing


def test_float16_saturates_instead_of_overflowing():
    y = compression.round_trip(torch.tensor([[1e6, -1e6, 3.0]]), "float16")
    assert torch.isfinite(y).all() and y[0, 0] == 65504 and y[0, 1] == -65504 and y[0, 2] == 3.0


def test_int8_is_per_row_symmetric_quantisation():
    x = torch.randn(SHAPE)
    x[3] = 0  # an all-zero sample stays zero
    packed = compression.pack(x, "int8")
    assert packed.values.dtype == torch.int8 and packed.scales.shape == (10,)
    assert packed.nbytes == compression.packed_nbytes(SHAPE, "int8") == 10 * 784 + 10 * 4
    # the direct computation: scale = max|row| / 127, q = round(x / scale)
    scale = x.abs().amax(dim=1) / 127
    assert torch.equal(packed.scales, scale)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    assert torch.equal(packed.values, torch.round(x / safe[:, None]).to(torch.int8))
    y = compression.unpack(packed)
    assert torch.equal(y[3], torch.zeros(784))
    assert ((x - y).abs() <= scale[:, None] / 2 + 1e-7).all()  # at most half a step off
    assert int(packed.values.abs().max()) == 127


def test_int8_vectors_and_scalars_have_one_scale():
    for t in (torch.randn(7), torch.tensor(2.5)):
        packed = compression.pack(t, "int8")
        assert packed.scales.shape == (1,)
        assert torch.allclose(compression.unpack(packed), t, atol=float(t.abs().max()) / 127)


def test_discriminator_states_pack_to_the_expected_layout():
    state = build_discriminator(ModelSpec(), seed=0).state_dict()
    layout = {n: (tuple(t.shape), t.dtype) for n, t in state.items()}
    fp32 = compression.state_nbytes(state)
    assert fp32 == 670_219 * 4
    for wire in ("float16", "bfloat16", "int8"):
        packed = compression.pack_state(state, wire)
        assert {n: (tuple(t.shape), t.dtype) for n, t in packed.items()} == compression.wire_layout(layout, wire)
        back = compression.unpack_state(packed, layout, wire)
        assert {n: (tuple(t.shape), t.dtype) for n, t in back.items()} == layout
    assert compression.state_nbytes(compression.pack_state(state, "float16")) * 2 == fp32
    assert compression.state_nbytes(compression.pack_state(state, "int8")) < 0.26 * fp32


def test_adam_step_counters_travel_exactly():
    state = {"w": torch.randn(4, 3), "adam.w.step": torch.tensor(12345.0)}
    packed = compression.pack_state(state, "int8")
    assert packed["adam.w.step"].dtype == torch.float32 and "adam.w.step#scale" not in packed


def test_bad_scales_are_refused():
    q = torch.ones(2, 3, dtype=torch.int8)
    for scales in (None, torch.ones(3), torch.tensor([1.0, float("nan")]), torch.tensor([1.0, -1.0]),
                   torch.ones(2, dtype=torch.float64)):
        with pytest.raises(compression.PackingError):
            compression.unpack(compression.Packed(q, scales))
    with pytest.raises(compression.PackingError):
        compression.unpack(compression.Packed(torch.ones(2, 3), torch.ones(2)))  # floats carry no scales


def test_config_refuses_unknown_wire_dtypes():
    with pytest.raises(ConfigError):
        TrainingConfig(wire_dtype="int4").validate()


# ---------------------------------------------------------------------------------------------
# codec

@pytest.mark.parametrize("wire", compression.WIRE_DTYPES)
def test_codec_round_trip_equals_the_library_rounding(wire):
    x = torch.randn(SHAPE) * 3
    msg = codec.encode_packed(compression.pack(x, wire))
    assert len(msg.data) + len(msg.scales) == compression.packed_nbytes(SHAPE, wire)
    back = codec.decode_packed(tensor_pb2.Tensor.FromString(msg.SerializeToString()), shape=SHAPE, wire_dtype=wire)
    assert torch.equal(back, compression.round_trip(x, wire))


def _int8_message(**changes) -> tensor_pb2.Tensor:
    msg = codec.encode_packed(compression.pack(torch.randn(SHAPE), "int8"))
    for key, value in changes.items():
        if key == "shape":
            del msg.shape[:]
            msg.shape.extend(value)
        else:
            setattr(msg, key, value)
    return msg


@pytest.mark.parametrize("changes, reason", [
    ({"scales": b""}, "scales"),  # int8 without scales
    ({"scales": b"\0" * 36}, "scales"),  # one scale short
    ({"scales": b"\0" * 44}, "scales"),  # one too many
    ({"scales": struct.pack("<10f", *([1.0] * 9 + [float("nan")]))}, "scales"),
    ({"scales": struct.pack("<10f", *([1.0] * 9 + [float("inf")]))}, "scales"),
    ({"scales": struct.pack("<10f", *([1.0] * 9 + [-1.0]))}, "scales"),
    ({"shape": [784, 10]}, "shape"),
    ({"shape": [10, 785]}, "shape"),
    ({"data": b"\0" * 100}, "size"),
    ({"dtype": tensor_pb2.DTYPE_FLOAT32}, "dtype"),  # a worker cannot choose its own precision
])
def test_hostile_int8_tensors_are_refused_with_a_reason(changes, reason):
    with pytest.raises(codec.InvalidTensor) as err:
        codec.decode_packed(_int8_message(**changes), shape=SHAPE, wire_dtype="int8")
    assert err.value.reason == reason


def test_hostile_half_precision_tensors_are_refused():
    nan = codec.encode_tensor(torch.full(SHAPE, float("nan"), dtype=torch.float16))
    with pytest.raises(codec.InvalidTensor) as err:
        codec.decode_packed(nan, shape=SHAPE, wire_dtype="float16")
    assert err.value.reason == "nonfinite"
    with_scales = codec.encode_packed(compression.pack(torch.randn(SHAPE), "float16"))
    with_scales.scales = b"\0" * 40
    with pytest.raises(codec.InvalidTensor) as err:
        codec.decode_packed(with_scales, shape=SHAPE, wire_dtype="float16")
    assert err.value.reason == "scales"
    with pytest.raises(codec.InvalidTensor) as err:  # float32 sent to a float16 run
        codec.decode_packed(codec.encode_tensor(torch.randn(SHAPE)), shape=SHAPE, wire_dtype="float16")
    assert err.value.reason == "dtype"
    with pytest.raises(codec.InvalidTensor) as err:  # bfloat16 sent to a float16 run
        codec.decode_packed(codec.encode_tensor(torch.randn(SHAPE).to(torch.bfloat16)), shape=SHAPE,
                            wire_dtype="float16")
    assert err.value.reason == "dtype"


def test_compressed_states_stream_and_reassemble():
    state = build_discriminator(ModelSpec(), seed=0).state_dict()
    layout = {n: (tuple(t.shape), t.dtype) for n, t in state.items()}
    for wire in ("float16", "int8"):
        packed = compression.pack_state(state, wire)
        assembler = codec.StateAssembler(compression.wire_layout(layout, wire))
        for chunk in codec.state_chunks(packed, 1, "worker-0"):
            assembler.accept(chunk)
        back = compression.unpack_state(assembler.finish(), layout, wire)
        assert all(torch.equal(back[n], compression.state_round_trip(state, wire)[n]) for n in layout)
    # a float32 state offered to an int8 receiver does not fit its layout
    assembler = codec.StateAssembler(compression.wire_layout(layout, "int8"))
    with pytest.raises(codec.InvalidTensor):
        for chunk in codec.state_chunks(state, 1, "worker-0"):
            assembler.accept(chunk)


def test_training_spec_carries_the_wire_dtype():
    config = TrainingConfig(wire_dtype="bfloat16").validate()
    assert training_spec.config_from_spec(training_spec.spec_from_config(config)).wire_dtype == "bfloat16"
    assert training_spec.config_from_spec(training_spec.spec_from_config(TrainingConfig())).wire_dtype == "float32"
