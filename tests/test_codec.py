import math
import subprocess
import sys

import pytest
import torch

from mdgan.config import ModelSpec, TrainingConfig
from services.common import codec, training_spec
from services.common.proto import peer_pb2, tensor_pb2

from conftest import REPO


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
                                   torch.int32, torch.uint8])
def test_tensor_roundtrip_is_exact(dtype):
    t = (torch.randn(3, 5, 7) * 50).to(dtype)
    back = codec.decode_tensor(codec.encode_tensor(t))
    assert back.dtype == dtype and back.shape == t.shape and torch.equal(back, t)


def test_payload_is_raw_bytes():
    msg = codec.encode_tensor(torch.zeros(10, 784))
    assert len(msg.data) == 10 * 784 * 4
    assert msg.ByteSize() - len(msg.data) < 20  # a few bytes of framing, not a pickle


def test_empty_and_scalar_tensors():
    for t in (torch.zeros(0, 3), torch.tensor(2.5)):
        back = codec.decode_tensor(codec.encode_tensor(t))
        assert back.shape == t.shape and torch.equal(back, t)


@pytest.mark.parametrize("mutate,reason", [
    (lambda m: m.ClearField("shape") or m.shape.extend([10, 783]), "shape"),
    (lambda m: setattr(m, "dtype", tensor_pb2.DTYPE_FLOAT64), "dtype"),
    (lambda m: setattr(m, "dtype", 99), "dtype"),
    (lambda m: setattr(m, "data", m.data + b"\0\0\0\0"), "size"),
    (lambda m: setattr(m, "data", m.data[:-4]), "size"),
    (lambda m: setattr(m, "data", b"\0\0\xc0\x7f" + m.data[4:]), "nonfinite"),  # NaN
    (lambda m: setattr(m, "data", b"\0\0\x80\x7f" + m.data[4:]), "nonfinite"),  # +Inf
])
def test_invalid_tensors_are_refused_with_a_reason(mutate, reason):
    msg = codec.encode_tensor(torch.zeros(10, 784))
    mutate(msg)
    with pytest.raises(codec.InvalidTensor) as info:
        codec.decode_tensor(msg, shape=(10, 784), dtype=torch.float32)
    assert info.value.reason == reason


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_and_inf_are_refused_in_every_float_dtype(dtype, bad):
    t = torch.zeros(10, 784, dtype=dtype)
    t[3, 5] = bad
    with pytest.raises(codec.InvalidTensor) as info:
        codec.decode_tensor(codec.encode_tensor(t), shape=(10, 784), dtype=dtype)
    assert info.value.reason == "nonfinite"
    assert torch.equal(codec.decode_tensor(codec.encode_tensor(torch.ones(10, 784, dtype=dtype))),
                       torch.ones(10, 784, dtype=dtype))


@pytest.mark.parametrize("wire", ["float32", "int8"])
def test_batch_encoder_builds_one_message_per_distinct_pair(wire):
    from mdgan.gan import GeneratedBatches
    from services.common.proto import coordinator_pb2

    def generated() -> GeneratedBatches:
        return GeneratedBatches(torch.randn(2, 10, 784), torch.randint(0, 10, (2, 10)))

    encoder, batches = codec.BatchEncoder(), generated()
    messages = [encoder.message(1, batches.for_worker(rank), wire) for rank in range(4)]
    # kappa = 2: ranks 0 and 2 get (X_0, X_1), ranks 1 and 3 get (X_1, X_0)
    assert messages[0] is messages[2] and messages[1] is messages[3] and messages[0] is not messages[1]
    for rank, message in enumerate(messages):
        batch = batches.for_worker(rank)
        sent = coordinator_pb2.ServerMessage.FromString(message.SerializeToString()).batches
        assert sent.iteration == 1
        got = codec.decode_packed(sent.generated, shape=(10, 784), wire_dtype=wire)
        expected = batch.generated if wire == "float32" else \
            codec.compression.unpack(codec.compression.pack(batch.generated, wire))
        assert torch.equal(got, expected)
        assert torch.equal(codec.decode_labels(sent.discriminated_labels, 10, 10, "labels"),
                           batch.discriminated_labels)
    again = generated()  # the next iteration: new batches, new messages
    assert encoder.message(2, again.for_worker(0), wire) is not messages[0]
    assert encoder.message(2, again.for_worker(2), wire) is encoder.message(2, again.for_worker(0), wire)


def test_size_bound_is_checked_before_anything_else():
    msg = codec.encode_tensor(torch.zeros(100, 784))
    with pytest.raises(codec.InvalidTensor) as info:
        codec.decode_tensor(msg, max_bytes=10 * 784 * 4)
    assert info.value.reason == "size"


def test_labels_out_of_range_are_refused():
    with pytest.raises(codec.InvalidTensor):
        codec.decode_labels(codec.encode_tensor(torch.tensor([0, 10])), 2, 10, "labels")


def _state():
    from mdgan.models import build_discriminator
    return {k: v.clone() for k, v in build_discriminator(ModelSpec(), 0).state_dict().items()}


def _layout(state):
    return {k: (tuple(v.shape), v.dtype) for k, v in state.items()}


def _reassemble(chunks, state):
    assembler = codec.StateAssembler(_layout(state))
    for chunk in chunks:
        assembler.accept(chunk)
    return assembler.finish()


def test_state_streams_in_chunks_of_at_most_one_mib_and_reassembles_exactly():
    state = _state()
    chunks = list(codec.state_chunks(state, 3, "worker-1"))
    assert chunks[0].WhichOneof("body") == "header" and chunks[0].header.total_bytes == 670_219 * 4
    assert all(len(c.data) <= codec.CHUNK_BYTES for c in chunks[1:])
    assert len(chunks) - 1 == math.ceil(670_219 * 4 / codec.CHUNK_BYTES)
    back = _reassemble(chunks, state)
    assert all(torch.equal(back[k], v) for k, v in state.items())


@pytest.mark.parametrize("chunk_bytes", [codec.CHUNK_BYTES, 4096, 1000, 7])
def test_a_state_written_straight_to_the_wire_parses_to_the_chunks_state_chunks_builds(chunk_bytes):
    # wire_state_chunks writes data chunks by hand (key, length, bytes) from the tensors' memory,
    # chunks that cross from one tensor into the next included; protobuf must read them back as
    # the messages state_chunks builds, and the sizes told to telemetry must be the real ones.
    state = _state() if chunk_bytes >= 4096 else {"a": torch.arange(5.0), "empty": torch.zeros(0),
                                                   "b": torch.arange(6, dtype=torch.int64).view(2, 3),
                                                   "scalar": torch.tensor(2.5)}
    wire = codec.wire_state_chunks(state, 3, "worker-1", "site-a", chunk_bytes=chunk_bytes)
    parsed = [peer_pb2.DiscriminatorChunk.FromString(w) for w, _ in wire]
    built = list(codec.state_chunks(state, 3, "worker-1", "site-a", chunk_bytes=chunk_bytes))
    total = sum(t.numel() * t.element_size() for t in state.values())
    assert parsed == built and len(parsed) == 1 + math.ceil(total / chunk_bytes)
    assert [payload for _, payload in wire] == [len(c.data) for c in built]
    assert [len(w) for w, _ in wire] == [c.ByteSize() for c in built]
    assert all(codec.data_chunk_bytes(len(c.data)) == c.ByteSize() for c in built[1:])
    back = _reassemble(parsed, state)
    assert all(torch.equal(back[k], v) for k, v in state.items())


def test_a_copy_is_marked_in_the_written_header():
    wire = codec.wire_state_chunks(_state(), 2, "worker-0", copy=True)
    header = peer_pb2.DiscriminatorChunk.FromString(wire[0][0]).header
    assert header.copy and header.round == 2 and header.sender_worker == "worker-0"
    assert not peer_pb2.DiscriminatorChunk.FromString(codec.wire_state_chunks(_state(), 2, "w")[0][0]).header.copy


@pytest.mark.parametrize("size", [0, 1, 127, 128, 16_383, 16_384, 2_097_152])
def test_a_data_chunks_size_is_known_without_serializing_it(size):
    assert codec.data_chunk_bytes(size) == peer_pb2.DiscriminatorChunk(data=b"x" * size).ByteSize()


def test_state_with_wrong_layout_is_refused_before_buffering():
    state = _state()
    wrong = dict(state)
    wrong["stack.0.weight"] = torch.zeros(512, 783)
    assembler = codec.StateAssembler(_layout(state))
    with pytest.raises(codec.InvalidTensor):
        assembler.accept(next(codec.state_chunks(wrong, 1, "x")))
    extra = dict(state, evil=torch.zeros(10))
    with pytest.raises(codec.InvalidTensor):
        codec.StateAssembler(_layout(state)).accept(next(codec.state_chunks(extra, 1, "x")))


def test_state_stream_errors():
    state = _state()
    layout = _layout(state)
    chunks = list(codec.state_chunks(state, 1, "x"))
    a = codec.StateAssembler(layout)
    with pytest.raises(codec.InvalidTensor):  # data before header
        a.accept(chunks[1])
    a = codec.StateAssembler(layout)
    for c in chunks[:-1]:
        a.accept(c)
    with pytest.raises(codec.InvalidTensor):  # truncated
        a.finish()
    a = codec.StateAssembler(layout)
    for c in chunks:
        a.accept(c)
    with pytest.raises(codec.InvalidTensor):  # more than announced
        a.accept(peer_pb2.DiscriminatorChunk(data=b"\0" * 4))
    nan_state = dict(state)
    nan_state["stack.4.bias"] = torch.full((11,), float("nan"))
    a = codec.StateAssembler(layout)
    for c in codec.state_chunks(nan_state, 1, "x"):
        a.accept(c)
    with pytest.raises(codec.InvalidTensor) as info:
        a.finish()
    assert info.value.reason == "nonfinite"


def test_training_spec_roundtrip():
    config = TrainingConfig(workers=5, kappa=2, batch_size=12, disc_steps=3, seed=77, swap_optimizer_state=True,
                            model=ModelSpec(gan="gan", loss="saturating")).validate()
    back = training_spec.config_from_spec(training_spec.spec_from_config(config))
    assert back.model == config.model and back.discriminator_optimizer == config.discriminator_optimizer
    for field in ("workers", "kappa", "batch_size", "disc_steps", "seed", "swap_optimizer_state"):
        assert getattr(back, field) == getattr(config, field)


def test_an_explicit_zero_stays_zero_on_the_wire_and_an_absent_field_means_what_it_meant_before():
    from mdgan.config import OptimizerSpec

    zero = OptimizerSpec(1e-3, 0.0, 0.0)
    config = TrainingConfig(workers=3, seed=0, generator_optimizer=zero, discriminator_optimizer=zero).validate()
    spec = training_spec.spec_from_config(config)
    assert spec.HasField("gen_beta2") and spec.gen_beta2 == 0.0
    back = training_spec.config_from_spec(spec)
    assert back.generator_optimizer == zero and back.discriminator_optimizer == zero
    # a spec from a sender before presence left its zeros out: gen_lr and gen_beta2 then meant the defaults
    old = training_spec.spec_from_config(config)
    for name in ("gen_lr", "gen_beta2", "disc_width", "dp_mechanism"):
        old.ClearField(name)
    before = training_spec.config_from_spec(old)
    assert (before.generator_optimizer.lr, before.generator_optimizer.beta2) == (OptimizerSpec.lr, OptimizerSpec.beta2)
    assert before.model.disc_width == ModelSpec.disc_width and before.privacy.mechanism == "sgd"


def test_every_setting_declared_for_the_workers_has_its_field_and_no_other_does():
    from mdgan import settings

    carried = {f.setting for f in training_spec.TRAINING_SPEC_FIELDS if f.setting}
    assert carried == {s.key for s in settings.TRAINING_SETTINGS if s.to_workers}
    names = {f.field for f in training_spec.TRAINING_SPEC_FIELDS}
    message = {f.name for f in training_spec.spec_from_config(TrainingConfig().validate()).DESCRIPTOR.fields}
    assert names <= message and message - names == {"sample_shape", "class_names", "algorithm", "mdgan", "pwgan",
                                                    "psgan"}


def test_generated_code_is_not_stale():
    result = subprocess.run([sys.executable, "scripts/generate_protos.py", "--check"], cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_library_never_imports_grpc_or_prometheus():
    code = ("import sys, mdgan.algorithms, mdgan.simulation, mdgan.run, mdgan.models, mdgan.data, mdgan.sites; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('grpc', 'prometheus_client', 'services')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
