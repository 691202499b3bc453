"""The parameter-server GAN over gRPC: real processes on loopback (mutual TLS where a
real worker runs), against the same run in one process, its traffic formula, a worker SIGKILLed
mid-run, and hostile input both ways."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import grpc
import pytest
import torch

from conftest import REPO
from mdgan.algorithms.psgan import traffic_per_iteration
from mdgan.config import DataConfig, ModelSpec, TrainingConfig
from mdgan.data import load_shard
from services.common import codec, pki
from services.common.proto import coordinator_pb2 as pb
from services.common.proto import coordinator_pb2_grpc, psgan_pb2
from mdgan_app.traffic import read_exposition
from services.worker.algorithms.base import ServerGone
from services.worker.algorithms.psgan import PSGANWorker
from services.worker.node import ServerLink, WorkerData, WorkerNode

from procs import mdgan, read_json, read_jsonl, start_server, start_worker, tls_flags, wait_for_iterations

INVALID_ARGUMENT = 3


def wire_payload(run_dir) -> dict[tuple[str, str], int]:
    """(direction, side) -> payload bytes counted by the run's processes (server and workers summed)."""
    totals: dict[tuple[str, str], int] = {}
    for name in os.listdir(os.path.join(run_dir, "metrics")):
        for (metric, direction, side, _), value in read_exposition(os.path.join(run_dir, "metrics", name)).items():
            if metric == "mdgan_wire_payload_bytes_total":
                totals[(direction, side)] = totals.get((direction, side), 0) + int(value)
    return totals


@pytest.mark.slow
def test_local_equals_simulate_bit_for_bit_and_the_wire_carries_the_formula(tmp_path, device):
    flags = ["--algorithm", "psgan", "--workers", "3", "--iterations", "6", "--disc-steps", "2", "--seed", "2",
             "--dataset", "synthetic", "--no-progress", "--device", device]
    mdgan("local", *flags, "--out", str(tmp_path / "local"))  # mutual TLS: a throwaway CA in local/tls
    mdgan("simulate", *flags, "--out", str(tmp_path / "simulate"))
    local, simulated = read_json(tmp_path / "local" / "summary.json"), read_json(tmp_path / "simulate" / "summary.json")
    assert local["algorithm"] == simulated["algorithm"] == "psgan"
    assert local["generator_sha256"] == simulated["generator_sha256"]
    assert local["iterations"] == 6 and local["workers_alive"] == 3 and local["psgan"] == {"threshold": 3}

    per_iteration = traffic_per_iteration(TrainingConfig(workers=3, batch_size=10, disc_steps=2,
                                                         model=ModelSpec(gan="acgan")), 3)
    expected = {k: 6 * per_iteration[k] for k in ("server_to_worker", "worker_to_server", "worker_to_worker")}
    # G (717,560 floats) once and D (670,219) in each of the R = 2 rounds, each way, per worker
    assert expected["server_to_worker"] == expected["worker_to_server"] == 6 * 3 * 4 * (717_560 + 2 * 670_219)
    assert local["payload_bytes"] == simulated["payload_bytes"] == expected
    # what every process counted on the wire, where it was sent and where it was received
    counted = wire_payload(tmp_path / "local")
    for direction in ("server_to_worker", "worker_to_server"):
        assert counted[(direction, "sender")] == counted[(direction, "receiver")] == expected[direction]
    assert counted.get(("worker_to_worker", "sender"), 0) == 0
    report = json.loads(mdgan("traffic", str(tmp_path / "local"), "--json").stdout)  # the same, as users see it
    assert report["algorithm"] == "psgan" and len(report["rows"]) == 6
    assert all(row["payload_bytes"] == row["formula_bytes"] == expected[row["direction"]] for row in report["rows"])


@pytest.mark.slow
def test_with_a_threshold_a_worker_sigkilled_mid_run_does_not_stop_the_run(tmp_path):
    out, authority = str(tmp_path), str(tmp_path / "pki")
    pki.provision_run(authority, [f"worker-{i}" for i in range(3)])
    server, port = start_server(out, "--algorithm", "psgan", "--ps-threshold", "2", "--workers", "3",
                                "--iterations", "12", "--gan", "gan", "--step-timeout", "30",
                                *tls_flags(authority, "mdgan-server"))
    workers = [start_worker(out, port, i, 3, "--dataset", "synthetic", "--server-timeout", "30",
                            "--tls-server-name", "mdgan-server", *tls_flags(authority, f"worker-{i}"))
               for i in range(3)]
    try:
        wait_for_iterations(server, out, 2)
        workers[2].popen.send_signal(signal.SIGKILL)
        assert server.wait(120) == 0, server.log()
        for w in workers[:2]:
            assert w.wait(30) == 0, w.log()
    finally:
        for p in (server, *workers):
            p.kill()
    summary = read_json(os.path.join(out, "summary.json"))
    assert summary["iterations"] == 12 and summary["stopped_early"] is None
    assert summary["workers"] == 3 and summary["workers_alive"] == 2
    history = read_jsonl(os.path.join(out, "history.jsonl"))
    assert history[0]["active_workers"] == 3 and history[-1]["active_workers"] == history[-1]["answered"] == 2
    assert sum(r["lost"] for r in history) == 1


def _join(shard: int) -> pb.WorkerMessage:
    return pb.WorkerMessage(join=pb.Join(shard_index=shard, shard_size=1000, peer_address="127.0.0.1:9",
                                         sample_shape=[784], num_classes=10))


async def _hostile_worker(port: int) -> tuple[list[pb.Rejection], grpc.StatusCode]:
    """Joins as worker 1 and answers each iteration's round with something wrong, then behaves; and
    tries a join once the run started."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = coordinator_pb2_grpc.CoordinatorStub(channel).Train(timeout=120)
        await call.write(_join(1))
        await asyncio.wait_for(call.read(), 60)  # welcome
        weights: dict[str, list[psgan_pb2.ReplicaPart]] = {}
        rejections, late_join = [], None
        while True:
            message = await asyncio.wait_for(call.read(), 60)
            kind = message.WhichOneof("body")
            if kind == "replica_part":
                weights.setdefault(message.replica_part.model, []).append(message.replica_part)
            elif kind == "replica_round":
                r = message.replica_round
                if late_join is None:  # the run has started: a newcomer is refused
                    late = coordinator_pb2_grpc.CoordinatorStub(channel).Train(timeout=30)
                    await late.write(_join(0))
                    late_join = await late.code()
                # the MLPs' parameters are their whole state: the weights, echoed, have the gradients' layout
                parts = []
                for model in ("discriminator", "generator"):
                    for p in weights.pop(model, []):
                        q = psgan_pb2.ReplicaPart()
                        q.CopyFrom(p)
                        q.content = "gradients"
                        parts.append(q)
                if r.iteration == 1:  # a tensor of another shape
                    parts[0].header.tensors[0].shape[-1] += 1
                elif r.iteration == 2:  # NaN in the data
                    parts[1].data = torch.full((len(parts[1].data) // 4,), float("nan")).numpy().tobytes()
                elif r.iteration == 3:  # weights, which a worker never sends
                    parts[0].content = "weights"
                elif r.iteration == 4:  # the round's answer without its gradients
                    parts = []
                for p in parts:
                    await call.write(pb.WorkerMessage(replica_part=p))
                await call.write(pb.WorkerMessage(replica_gradients=psgan_pb2.ReplicaGradients(
                    iteration=r.iteration, round=r.round)))
            elif kind == "rejection":
                rejections.append(message.rejection)
            elif kind == "stop":
                await call.done_writing()
                return rejections, late_join


@pytest.mark.slow
def test_hostile_gradients_are_rejected_with_invalid_argument_and_the_run_goes_on_without_newcomers(tmp_path):
    out = str(tmp_path)
    server, port = start_server(out, "--algorithm", "psgan", "--ps-threshold", "1", "--workers", "2",
                                "--iterations", "5", "--gan", "gan")
    worker = start_worker(out, port, 0, 2, "--dataset", "synthetic")
    try:
        rejections, late_join = asyncio.run(_hostile_worker(port))
        assert server.wait(60) == 0, server.log()
        assert worker.wait(30) == 0, worker.log()
    finally:
        server.kill()
        worker.kill()
    assert late_join == grpc.StatusCode.FAILED_PRECONDITION
    assert [(r.iteration, r.code, r.reason) for r in rejections] == [
        (1, INVALID_ARGUMENT, "shape"), (2, INVALID_ARGUMENT, "nonfinite"), (3, INVALID_ARGUMENT, "protocol"),
        (4, INVALID_ARGUMENT, "protocol")]
    summary = read_json(os.path.join(out, "summary.json"))
    assert summary["iterations"] == 5 and summary["workers_alive"] == 2 and summary["rejections"] == 4
    assert [r["answered"] for r in read_jsonl(os.path.join(out, "history.jsonl"))] == [1, 1, 1, 1, 2]
    assert "Traceback" not in server.log()


def test_a_worker_stops_with_a_clear_error_on_invalid_weights():
    config = TrainingConfig(workers=2, batch_size=10, model=ModelSpec(gan="gan")).validate()
    shard = load_shard(DataConfig("synthetic", num_shards=2), 0)
    node = WorkerNode(ServerLink("127.0.0.1:9"), WorkerData(shard=shard), advertise_address="127.0.0.1:9")
    state = PSGANWorker(node, config, shard).side.discriminator.state_dict()

    def parts(iteration: int, round_: int, content: str = "weights", model: str = "discriminator"):
        return list(codec.replica_parts(state, iteration, round_, model, content))

    async def feed(messages, order: psgan_pb2.ReplicaRound | None = None):
        worker = PSGANWorker(node, config, shard)  # a fresh one: each case starts clean
        for part in messages:
            await worker._on_part(None, part)
        if order is not None:
            await worker._on_round(None, order)

    cases = [
        (parts(1, 1, content="gradients"), None, "a replica takes the models' weights only"),
        (parts(1, 1, model="critic"), None, "a replica takes the models' weights only"),
        (parts(1, 1)[:1] + parts(1, 1)[:1], None, "second header"),
        ([], psgan_pb2.ReplicaRound(iteration=1, round=1), "no weights came"),
        (parts(1, 1)[:1], psgan_pb2.ReplicaRound(iteration=1, round=1), "stream ended after 0 of"),
        (parts(1, 1), psgan_pb2.ReplicaRound(iteration=1, round=1, want_generator=True), "round 1 must carry"),
        (parts(1, 2), psgan_pb2.ReplicaRound(iteration=1, round=2, want_generator=True), "without its round 1"),
    ]
    for messages, order, why in cases:
        with pytest.raises(ServerGone, match=why):
            asyncio.run(feed(messages, order))


def test_options_that_do_not_apply_are_refused(tmp_path):
    server = subprocess.run([sys.executable, "-m", "services.server", "--algorithm", "psgan", "--insecure",
                             "--wire-dtype", "float16", "--metrics-port", "0", "--out", str(tmp_path / "s")],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert server.returncode == 2 and "--wire-dtype float16 is MD-GAN's" in server.stderr
    local = mdgan("local", "--algorithm", "psgan", "--workers", "3", "--ps-threshold", "4", "--out",
                  str(tmp_path / "l"), check=False)
    assert local.returncode == 2 and "--ps-threshold must be in [1, workers=3], got 4" in local.stderr
