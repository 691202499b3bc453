"""The parallel Wasserstein GAN over the services: real processes, real gRPC (mutual TLS where the
cluster is real), against the same algorithm in one process (mdgan/algorithms/pwgan.py)."""

from __future__ import annotations

import asyncio
import os
import signal

import grpc
import pytest
import torch

from mdgan.config import TrainingConfig
from procs import mdgan, read_json, read_jsonl, start_server, start_worker, tls_flags, wait_for_iterations
from services.common import codec, pki, training_spec
from services.common.proto import coordinator_pb2 as pb
from services.common.proto import coordinator_pb2_grpc, pwgan_pb2
from mdgan_app.traffic import read_exposition, traffic_report

pytestmark = pytest.mark.slow

D = 784  # the synthetic dataset's samples are MNIST-shaped
INVALID_ARGUMENT = 3


def per_iteration(workers: int, b: int, rounds: int) -> int:
    """docs/ALGORITHMS.md, P-WGAN's Table III: 4 n_g d + 4 T n_g bytes per worker, each way."""
    return workers * (4 * b * D + 4 * rounds * b)


def test_local_equals_simulate_bit_for_bit_and_the_counters_equal_the_formula(tmp_path, device):
    flags = ["--algorithm", "pwgan", "--workers", "3", "--iterations", "8", "--batch-size", "10", "--disc-steps", "2",
             "--potential-rounds", "3", "--potential-lr", "0.5", "--gradient-penalty", "5", "--seed", "4",
             "--dataset", "synthetic", "--no-progress", "--device", device]
    mdgan("local", *flags, "--out", str(tmp_path / "local"))  # mutual TLS, a throwaway CA
    mdgan("simulate", *flags, "--out", str(tmp_path / "simulate"))
    local, simulated = read_json(tmp_path / "local" / "summary.json"), read_json(tmp_path / "simulate" / "summary.json")

    assert local["mode"] == "local" and local["algorithm"] == simulated["algorithm"] == "pwgan"
    assert local["generator_sha256"] == simulated["generator_sha256"]
    assert local["iterations"] == 8 and local["workers"] == local["workers_alive"] == 3

    # P-WGAN's formula (mdgan.algorithms.pwgan.traffic_per_iteration) times the iterations, in both runs
    each_way = 8 * per_iteration(3, 10, 3)
    expected = {"server_to_worker": each_way, "worker_to_server": each_way, "worker_to_worker": 0}
    assert local["payload_bytes"] == simulated["payload_bytes"] == expected
    assert local["label_bytes"] == simulated["label_bytes"] == 8 * 3 * 10 * 8  # ACGAN labels, round 1, apart
    for direction in ("server_to_worker", "worker_to_server"):
        assert expected[direction] < local["message_bytes"][direction] < 1.02 * expected[direction]

    # Every process's Prometheus counters, at both ends of each direction.
    metrics = tmp_path / "local" / "metrics"
    processes = {name[:-5]: read_exposition(str(metrics / name)) for name in os.listdir(metrics)}
    assert sorted(processes) == ["server", "worker-0", "worker-1", "worker-2"]

    def payload(process: str, direction: str, side: str, kind: str | None = None) -> int:
        return int(sum(v for (metric, d, s, k), v in processes[process].items()
                       if metric == "mdgan_wire_payload_bytes_total" and d == direction and s == side
                       and (kind is None or k == kind)))

    assert payload("server", "server_to_worker", "sender") == payload("server", "worker_to_server", "receiver") \
        == each_way
    for w in ("worker-0", "worker-1", "worker-2"):
        assert payload(w, "server_to_worker", "receiver") == payload(w, "worker_to_server", "sender") == each_way // 3
        # X_g once an iteration (with phi of round 1); phi alone in rounds 2..T; N^k each round, F_k in round T
        assert payload(w, "server_to_worker", "receiver", "batches") == 8 * (4 * 10 * D + 4 * 10)
        assert payload(w, "server_to_worker", "receiver", "potentials") == 8 * 2 * 4 * 10
        assert payload(w, "worker_to_server", "sender", "counts") == 8 * 2 * 4 * 10
        assert payload(w, "worker_to_server", "sender", "feedback") == 8 * (4 * 10 * D + 4 * 10)
    assert all(payload(p, "worker_to_worker", side) == 0 for p in processes for side in ("sender", "receiver"))
    # `mdgan traffic` reads the same counters (its formula per algorithm is mdgan_app/traffic.py's)
    report = traffic_report(str(tmp_path / "local"))
    assert all(r["payload_bytes"] == expected[r["direction"]] for r in report["rows"])


def test_a_worker_killed_mid_run_leaves_and_the_others_go_on(tmp_path):
    out = str(tmp_path)
    pki_dir = os.path.join(out, "pki")
    pki.provision_run(pki_dir, [f"worker-{i}" for i in range(3)])
    server, port = start_server(out, "--algorithm", "pwgan", "--workers", "3", "--iterations", "60",
                                "--potential-rounds", "2", "--gan", "gan", "--step-timeout", "20",
                                *tls_flags(pki_dir, "mdgan-server"))
    workers = [start_worker(out, port, i, 3, "--dataset", "synthetic", "--name", f"worker-{i}",
                            *tls_flags(pki_dir, f"worker-{i}")) for i in range(3)]
    try:
        history = os.path.join(out, "history.jsonl")
        wait_for_iterations(server, out, 15)
        workers[1].popen.send_signal(signal.SIGKILL)
        assert server.wait(120) == 0, server.log()
        summary = read_json(os.path.join(out, "summary.json"))
        records = read_jsonl(history)
        for w in (workers[0], workers[2]):
            assert w.wait(30) == 0, w.log()
    finally:
        for p in [server, *workers]:
            p.kill()
    assert "mutual TLS" in server.log()
    assert summary["algorithm"] == "pwgan" and summary["iterations"] == 60 and len(records) == 60
    assert summary["workers"] == 3 and summary["workers_alive"] == 2
    lost_at = [r for r in records if r["lost"]]
    assert len(lost_at) == 1 and lost_at[0]["seconds"] < 20 + 5  # one deadline at most, never a hang
    after = records[records.index(lost_at[0]) + 1:]
    assert after and all(r["active_workers"] == r["answered"] == 2 for r in after)
    assert records[0]["active_workers"] == records[0]["answered"] == 3


def _good_counts(b: int = 10) -> pb.Tensor:
    return codec.encode_tensor(torch.tensor([b] + [0] * (b - 1), dtype=torch.int32))


def _answers(iteration: int, round_: int, last: bool) -> list[pwgan_pb2.PotentialCounts]:
    """A hostile worker's answers: one kind of bad input per iteration, then good ones."""
    good = dict(iteration=iteration, round=round_, counts=_good_counts())
    if last:
        good.update(feedback=codec.encode_tensor(torch.zeros(10, D)), transport_cost=1.0, disc_loss=0.5)
    bad = {
        (1, 1): dict(good, counts=codec.encode_tensor(torch.tensor([10] + [0] * 9, dtype=torch.int64))),  # dtype
        (2, 1): dict(good, counts=codec.encode_tensor(torch.tensor([9] + [0] * 9, dtype=torch.int32))),  # sum != n_r
        (3, 2): dict(good, feedback=codec.encode_tensor(torch.full((10, D), float("nan")))),  # non-finite F_k
        (4, 1): dict(good, feedback=codec.encode_tensor(torch.zeros(10, D))),  # F_k before the last round
        (6, 2): {k: v for k, v in good.items() if k != "feedback"},  # the last round without F_k
        (7, 1): dict(good, counts=codec.encode_tensor(torch.zeros(11, dtype=torch.int32))),  # shape
    }
    if (iteration, round_) == (5, 1):  # an answer to a round nobody asked, then the right one
        return [pwgan_pb2.PotentialCounts(iteration=5, round=9, counts=_good_counts()),
                pwgan_pb2.PotentialCounts(**good)]
    return [pwgan_pb2.PotentialCounts(**bad.get((iteration, round_), good))]


async def _hostile_worker(port: int):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = coordinator_pb2_grpc.CoordinatorStub(channel).Train(timeout=120)
        await call.write(pb.WorkerMessage(join=pb.Join(shard_index=1, shard_size=1000, peer_address="127.0.0.1:9",
                                                       sample_shape=[D], num_classes=10)))
        welcome = (await asyncio.wait_for(call.read(), 60)).welcome
        rounds, rejections = [], []
        while True:
            message = await asyncio.wait_for(call.read(), 60)
            assert message is not grpc.aio.EOF
            kind = message.WhichOneof("body")
            if kind == "potential_round":
                r = message.potential_round
                rounds.append((r.iteration, r.round))
                for answer in _answers(r.iteration, r.round, r.last):
                    await call.write(pb.WorkerMessage(potential_counts=answer))
            elif kind == "rejection":
                rejections.append(message.rejection)
            elif kind == "stop":
                await call.done_writing()
                return welcome, rounds, rejections


def test_hostile_counts_and_feedback_are_refused_and_the_run_goes_on(tmp_path):
    out = str(tmp_path)
    server, port = start_server(out, "--algorithm", "pwgan", "--workers", "2", "--iterations", "8",
                                "--potential-rounds", "2", "--batch-size", "10", "--gan", "gan")
    worker = start_worker(out, port, 0, 2, "--dataset", "synthetic")
    try:
        welcome, rounds, rejections = asyncio.run(_hostile_worker(port))
        assert server.wait(60) == 0, server.log()
        assert worker.wait(30) == 0, worker.log()
    finally:
        server.kill()
        worker.kill()
    spec = welcome.spec
    assert (spec.algorithm, spec.pwgan.potential_rounds, spec.pwgan.potential_lr,
            spec.pwgan.gradient_penalty) == ("pwgan", 2, 1.0, 10.0)
    # a worker refused in a round sits out the rest of that iteration, and is back for the next
    assert [t for t, r in rounds if r == 2] == [3, 5, 6, 8]
    assert all(r.code == INVALID_ARGUMENT for r in rejections)
    assert [(r.iteration, r.reason) for r in rejections] == [
        (1, "dtype"), (2, "bad_counts"), (3, "nonfinite"), (4, "protocol"), (5, "iteration"), (6, "missing"),
        (7, "shape")]
    summary = read_json(os.path.join(out, "summary.json"))
    assert summary["iterations"] == 8 and summary["workers_alive"] == 2 and summary["rejections"] == 6
    history = read_jsonl(os.path.join(out, "history.jsonl"))
    assert [r["answered"] for r in history] == [1, 1, 1, 1, 2, 1, 1, 2]
    assert [r["rejected"] for r in history] == [1, 1, 1, 1, 0, 1, 1, 0]
    assert "Traceback" not in server.log() + worker.log()


class _HostileCoordinator(coordinator_pb2_grpc.CoordinatorServicer):
    """Welcomes a worker into a P-WGAN run, then sends it one bad message."""

    def __init__(self, spec: pb.TrainingSpec, bad: pb.ServerMessage | None):
        self.spec, self.bad = spec, bad

    async def Train(self, request_iterator, context):
        join = await context.read()
        await context.write(pb.ServerMessage(welcome=pb.Welcome(worker_id="worker-0", shard_index=join.join.shard_index,
                                                                spec=self.spec, heartbeat_interval_ms=1000)))
        if self.bad is not None:
            await context.write(self.bad)
        while await context.read() is not grpc.aio.EOF:
            pass


@pytest.mark.parametrize("case", ["zero_rounds", "potentials_shape", "late_round"])
def test_a_worker_refuses_a_server_that_breaks_the_protocol(tmp_path, case):
    spec = training_spec.spec_from_config(TrainingConfig(workers=2, batch_size=10).validate(), "pwgan")
    spec.pwgan.potential_rounds = 0 if case == "zero_rounds" else 2
    spec.pwgan.potential_lr, spec.pwgan.gradient_penalty = 1.0, 10.0
    phi = codec.encode_tensor(torch.zeros(10 if case != "potentials_shape" else 11))
    bad = {"zero_rounds": None,
           "potentials_shape": pwgan_pb2.PotentialRound(iteration=1, round=1, potentials=phi,
                                                        generated=codec.encode_tensor(torch.zeros(10, D))),
           "late_round": pwgan_pb2.PotentialRound(iteration=1, round=2, potentials=phi)}[case]
    expected = {"zero_rounds": "P-WGAN options are invalid", "potentials_shape": "invalid potential round",
                "late_round": "without its round 1"}[case]

    async def scenario() -> str:
        server = grpc.aio.server()
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(
            _HostileCoordinator(spec, None if bad is None else pb.ServerMessage(potential_round=bad)), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            worker = start_worker(str(tmp_path), port, 0, 2, "--dataset", "synthetic", "--server-timeout", "10")
            code = await asyncio.to_thread(worker.wait, 60)
            return code, worker.log()
        finally:
            await server.stop(None)

    code, log = asyncio.run(scenario())
    assert code == 2, log
    assert expected in log and "Traceback" not in log, log


def test_a_join_after_the_start_is_refused():
    """P-WGAN's critics are fixed when the run starts: a late worker gets FAILED_PRECONDITION."""
    from services.server.coordinator import Coordinator

    async def scenario() -> tuple[grpc.StatusCode, str]:
        coordinator = Coordinator(TrainingConfig(workers=2, batch_size=10).validate(), algorithm="pwgan")
        coordinator.roster.started = True
        server = grpc.aio.server()
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(coordinator, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = coordinator_pb2_grpc.CoordinatorStub(channel).Train(timeout=10)
                await call.write(pb.WorkerMessage(join=pb.Join(shard_index=1, shard_size=1000, sample_shape=[D],
                                                               num_classes=10, peer_address="127.0.0.1:9")))
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call.read()
                return refused.value.code(), refused.value.details()
        finally:
            await server.stop(None)

    code, details = asyncio.run(scenario())
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "P-WGAN" in details


@pytest.mark.parametrize("flags, message", [
    (["--checkpoint-every", "5"], "--checkpoint-every and --resume work "),
    (["--wire-dtype", "int8"], "travel as float32 only"),
    (["--sync", "quorum"], "wait for every live worker"),
    (["--potential-rounds", "0"], "--potential-rounds must be at least 1"),
])
def test_options_that_do_not_apply_are_refused(tmp_path, capsys, flags, message):
    from mdgan_app.cli import main

    for command in ("local", "simulate"):  # one refusal for both (mdgan/algorithms/__init__.py, refuse)
        code = main([command, "--algorithm", "pwgan", "--workers", "2", "--dataset", "synthetic",  # before any
                     "--iterations", "2", "--out", str(tmp_path / command), "--no-progress", *flags])  # process starts
        assert code == 2 and message in capsys.readouterr().err
