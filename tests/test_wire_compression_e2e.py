"""Wire compression over real processes: the same generator as in one process, and the bytes it saves."""

from __future__ import annotations

import json
import os

import pytest

from procs import mdgan, read_json
from test_e2e import D, THETA, table_iii

pytestmark = pytest.mark.slow

FLAGS = ["--workers", "3", "--kappa", "2", "--iterations", "6", "--batch-size", "10", "--swap-every", "3",
         "--seed", "4", "--eval-every", "-1", "--no-progress"]


def _local_and_simulated(tmp_path, mnist_root, wire: str, *extra: str) -> tuple[dict, dict]:
    flags = [*FLAGS, "--data-root", mnist_root, "--wire-dtype", wire, *extra]
    mdgan("local", *flags, "--out", str(tmp_path / "local"))
    mdgan("simulate", *flags, "--out", str(tmp_path / "simulate"))
    return read_json(tmp_path / "local" / "summary.json"), read_json(tmp_path / "simulate" / "summary.json")


def test_float16_halves_table_iii_and_local_equals_simulate(tmp_path, mnist_root):
    local, simulated = _local_and_simulated(tmp_path, mnist_root, "float16")
    assert local["generator_sha256"] == simulated["generator_sha256"]
    assert local["swaps"] == simulated["swaps"] == 2
    fp32 = table_iii(6, 3, 10, swaps=2)
    half = {direction: nbytes // 2 for direction, nbytes in fp32.items()}
    assert 2 * half["worker_to_worker"] == fp32["worker_to_worker"]  # |theta| floats, every one halved
    assert local["payload_bytes"] == simulated["payload_bytes"] == half
    # every process's Prometheus counters say the same, at both ends of every direction
    report = json.loads(mdgan("traffic", str(tmp_path / "local"), "--json").stdout)
    assert report["wire_dtype"] == "float16"
    for row in report["rows"]:
        assert row["payload_bytes"] == half[row["direction"]] == row["formula_bytes"], row
        assert row["ratio_to_fp32"] == 0.5


def test_int8_local_equals_simulate_at_a_quarter_of_the_bytes(tmp_path, mnist_root, device):
    # with an emulated attacker (mdgan-worker --attack) and a robust rule on the way: both transports
    # still agree bit for bit (the attacker's noise is seeded, the median is summed in rank order)
    local, simulated = _local_and_simulated(tmp_path, mnist_root, "int8", "--aggregation", "median",
                                            "--byzantine", "1", "--attack", "noise", "--device", device)
    assert local["generator_sha256"] == simulated["generator_sha256"]
    assert "emulating a Byzantine worker" in (tmp_path / "local" / "logs" / "worker-2.log").read_text()
    b = 10
    per_tensor = b * D + 4 * b  # one byte a value, one float32 scale per sample
    assert local["payload_bytes"]["server_to_worker"] == 6 * 3 * 2 * per_tensor
    assert local["payload_bytes"]["worker_to_server"] == 6 * 3 * per_tensor
    assert local["payload_bytes"] == simulated["payload_bytes"]
    fp32 = table_iii(6, 3, 10, swaps=2)
    for direction, nbytes in local["payload_bytes"].items():
        assert nbytes <= 0.26 * fp32[direction], direction
    assert local["payload_bytes"]["worker_to_worker"] > 2 * 3 * THETA  # at least a byte a weight
    report = json.loads(mdgan("traffic", str(tmp_path / "local"), "--json").stdout)
    assert all(row["payload_matches_formula"] for row in report["rows"]), report["rows"]


def _hostile_int8_feedback(iteration: int):
    import struct

    import torch

    from mdgan import compression
    from services.common import codec

    good = codec.encode_packed(compression.pack(torch.randn(10, D), "int8"))
    if iteration == 1:
        good.scales = struct.pack("<10f", *([1.0] * 9 + [float("nan")]))  # a NaN scale
    elif iteration == 2:
        good.scales = b""  # int8 without its scales
    elif iteration == 3:
        good.scales = struct.pack("<10f", *([-1.0] * 10))  # negative scales
    elif iteration == 4:
        return codec.encode_tensor(torch.zeros(10, D))  # float32 on an int8 run
    return good


def test_hostile_compressed_feedback_is_refused_in_band(tmp_path):
    import asyncio

    import grpc

    from procs import read_jsonl, start_server, start_worker
    from services.common.proto import coordinator_pb2 as pb
    from services.common.proto import coordinator_pb2_grpc

    async def fake_worker(port: int):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = coordinator_pb2_grpc.CoordinatorStub(channel).Train(timeout=120)
            await call.write(pb.WorkerMessage(join=pb.Join(shard_index=1, shard_size=1000, peer_address="127.0.0.1:9",
                                                           sample_shape=[D], num_classes=10)))
            welcome = await asyncio.wait_for(call.read(), 60)
            assert welcome.welcome.spec.wire_dtype == "int8"
            rejections = []
            while True:
                message = await asyncio.wait_for(call.read(), 60)
                kind = message.WhichOneof("body")
                if kind == "batches":
                    t = message.batches.iteration
                    assert message.batches.generated.dtype == 8 and len(message.batches.generated.scales) == 40
                    await call.write(pb.WorkerMessage(feedback=pb.Feedback(
                        iteration=t, gradient=_hostile_int8_feedback(t))))
                elif kind == "rejection":
                    rejections.append((message.rejection.iteration, message.rejection.code, message.rejection.reason))
                elif kind == "stop":
                    await call.done_writing()
                    return rejections

    out = str(tmp_path)
    server, port = start_server(out, "--workers", "2", "--iterations", "6", "--swap-every", "1000",
                                "--wire-dtype", "int8", "--peer-check", "off")  # the fake worker serves no Peer
    worker = start_worker(out, port, 0, 2, "--dataset", "synthetic")
    try:
        rejections = asyncio.run(fake_worker(port))
        assert server.wait(60) == 0, server.log()
        assert worker.wait(30) == 0, worker.log()
    finally:
        server.kill()
        worker.kill()
    assert rejections == [(1, 3, "scales"), (2, 3, "scales"), (3, 3, "scales"), (4, 3, "dtype")]
    assert [r["answered"] for r in read_jsonl(os.path.join(out, "history.jsonl"))] == [1, 1, 1, 1, 2, 2]
