"""Secure by default, tried as an attacker would: real processes, real mutual TLS, on loopback."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import REPO
from mdgan.config import ModelSpec, TrainingConfig
from mdgan.models import build_discriminator
from services.common import codec, pki, rpc
from services.common.proto import coordinator_pb2 as pb
from services.common.proto import coordinator_pb2_grpc, peer_pb2, tensor_pb2
from services.common.tls import TLSConfig
from services.server.admission import Admission
from services.server.coordinator import Coordinator

from procs import mdgan_in_process, read_json, read_jsonl, start_server, start_worker, tls_flags, wait_for_iterations

TRAIN = "/mdgan.v1.Coordinator/Train"
PUSH = "/mdgan.v1.Peer/PushDiscriminator"
CHECK = "/grpc.health.v1.Health/Check"
REFLECT = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"


def credentials(pki_dir: str, name: str) -> TLSConfig:
    paths = pki.identity_paths(pki_dir, name)
    return TLSConfig.load(paths["ca"], paths["cert"], paths["key"])


def open_channel(port: int, who: TLSConfig | None, *, server_name: str | None = None, ca: bytes | None = None):
    """A channel as `who` (None: plaintext); `ca` alone: TLS without a client certificate."""
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    if who is not None:
        return grpc.aio.secure_channel(f"127.0.0.1:{port}", who.channel_credentials(), options=options)
    if ca is not None:
        return grpc.aio.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials(ca), options=options)
    return grpc.aio.insecure_channel(f"127.0.0.1:{port}")


async def raw_call(channel, method: str, messages: list[bytes], timeout: float = 5.0, unary: bool = False
                   ) -> grpc.StatusCode:
    """Send raw bytes (anything at all) to a method; the call's final status."""
    try:
        if unary:
            await channel.unary_unary(method)(messages[0], timeout=timeout)
            return grpc.StatusCode.OK
        call = channel.stream_stream(method)(timeout=timeout)
        try:
            for m in messages:
                await call.write(m)
            await call.done_writing()
        except Exception:  # noqa: BLE001 -- AioRpcError, InvalidStateError, or grpc's own ExecuteBatchError
            pass  # the server ended the call while we wrote (or closed); its status says why
        while await call.read() is not grpc.aio.EOF:
            pass
        return await call.code()
    except grpc.aio.AioRpcError as exc:
        return exc.code()


async def health_status(port: int, who: TLSConfig | None, server_name: str | None = None) -> grpc.StatusCode | int:
    async with open_channel(port, who, server_name=server_name) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            return reply.status
        except grpc.aio.AioRpcError as exc:
            return exc.code()


def zeroed_discriminator_chunks(swap_round: int, claimed_sender: str) -> list[peer_pb2.DiscriminatorChunk]:
    """A well-formed discriminator (the run's layout: MLP, plain GAN) whose weights are all zero."""
    model = build_discriminator(ModelSpec(gan="gan"), 0)
    state = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    return list(codec.state_chunks(state, swap_round, claimed_sender, claimed_sender))


def peer_port(log_path: str, timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(log_path):
            with open(log_path) as fh:
                match = re.search(r"serving mdgan\.v1\.Peer on port (\d+)", fh.read())
            if match:
                return int(match.group(1))
        time.sleep(0.1)
    raise AssertionError(f"no Peer port in {log_path}")


@pytest.fixture(scope="module")
def run_pki(tmp_path_factory):
    """The run's PKI (server, two workers, and an intruder holding a valid worker certificate), and a
    rogue CA's worker certificate."""
    root = tmp_path_factory.mktemp("pki")
    good, rogue = str(root / "run"), str(root / "rogue")
    pki.provision_run(good, ["worker-0", "worker-1", "mallory"])
    pki.provision_run(rogue, ["worker-1"])
    return good, rogue


# -- 1. outsiders cannot reach anything -----------------------------------------------------------

@pytest.mark.slow
def test_mdgan_local_refuses_clients_without_a_certificate_of_its_ca(tmp_path, run_pki):
    _, rogue_dir = run_pki
    out = tmp_path / "local"
    # long enough to outlast the attacks whatever the machine's load; interrupted once they are done
    local = subprocess.Popen([sys.executable, "-m", "mdgan_app.cli", "local", "--workers", "2", "--iterations", "100000",
                              "--dataset", "synthetic", "--gan", "gan", "--no-progress", "--out", str(out)],
                             cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not read_jsonl(out / "history.jsonl"):  # both workers joined, training under way
            assert time.monotonic() < deadline and local.poll() is None, local.communicate()[0]
            time.sleep(0.1)
        server_port = int((out / "server.port").read_text())
        worker_port = peer_port(str(out / "logs" / "worker-0.log"))
        # a certificate of this run (issued by the run's own throwaway CA) gets through...
        probe = credentials(str(out / "tls"), "worker-1")
        rogue = credentials(rogue_dir, "worker-1")  # ...the same name, signed by another CA, does not

        async def attacks():
            results = {"probe server": await health_status(server_port, probe),
                       "probe worker": await health_status(worker_port, probe, server_name="worker-0")}
            join = pb.WorkerMessage(join=pb.Join(shard_index=1, shard_size=1000, peer_address="127.0.0.1:9",
                                                 sample_shape=[784], num_classes=10, name="worker-1")).SerializeToString()
            push = [c.SerializeToString() for c in zeroed_discriminator_chunks(1, "worker-1")]
            for label, who, ca in (("no certificate", None, probe.ca), ("plaintext", None, None),
                                   ("another CA", rogue, None)):
                async with open_channel(server_port, who, ca=ca) as channel:
                    results[f"join, {label}"] = await raw_call(channel, TRAIN, [join])
                async with open_channel(worker_port, who, server_name="worker-0", ca=ca) as channel:
                    results[f"push, {label}"] = await raw_call(channel, PUSH, push)
            results["probe server after"] = await health_status(server_port, probe)
            return results

        results = asyncio.run(attacks())
        with open(out / "metrics_targets.json") as fh:
            server_metrics = [g for g in json.load(fh) if g["labels"]["process"] == "server"][0]["targets"][0]
        with urllib.request.urlopen(f"http://{server_metrics}/metrics", timeout=10) as reply:
            exposition = reply.read().decode()
    finally:
        if local.poll() is None:
            local.send_signal(signal.SIGINT)  # mdgan local stops its processes
            local.communicate(timeout=60)
    serving = health_pb2.HealthCheckResponse.SERVING
    assert [results.pop(k) for k in ("probe server", "probe worker", "probe server after")] == [serving] * 3
    assert results == {k: grpc.StatusCode.UNAVAILABLE for k in results}, results  # the TLS handshake fails
    assert "mdgan_worker_joins_total 2.0" in exposition and "mdgan_workers_alive 2.0" in exposition
    for name in ("server", "worker-0", "worker-1"):
        assert "Traceback" not in (out / "logs" / f"{name}.log").read_text()


# -- 2. a valid certificate does not make a designated sender -----------------------------------------

@pytest.mark.slow
def test_a_push_from_anyone_but_the_designated_sender_is_refused_and_changes_nothing(tmp_path, run_pki):
    pki_dir, _ = run_pki
    # long enough (20 swap rounds) for the pushes below to land while the run is on, even on a busy machine
    flags = ["--workers", "2", "--iterations", "40", "--swap-every", "2", "--seed", "3", "--gan", "gan"]
    out = str(tmp_path / "grpc")
    server, port = start_server(out, *flags, "--swap-timeout", "30", *tls_flags(pki_dir, "mdgan-server"))
    workers = [start_worker(out, port, i, 2, "--dataset", "synthetic", *tls_flags(pki_dir, f"worker-{i}"),
                            "--metrics-dump", os.path.join(out, "metrics", f"worker-{i}.prom")) for i in range(2)]
    mallory, impostor = credentials(pki_dir, "mallory"), credentials(pki_dir, "worker-1")
    try:
        target = peer_port(workers[0].log_path)
        wait_for_iterations(server, out, 1)  # the run is under way

        async def judged_push(who, sender: str = "worker-1") -> tuple[grpc.StatusCode, list[bytes]]:
            """Push a zeroed D for the round after next; aimed again when the run's rounds raced past
            it before it arrived (FAILED_PRECONDITION), so that the sender check is what answers."""
            for _ in range(5):
                done = len(read_jsonl(os.path.join(out, "swaps.jsonl")))
                chunks = [c.SerializeToString() for c in zeroed_discriminator_chunks(done + 2, sender)]
                async with open_channel(target, who, server_name="worker-0") as channel:
                    code = await raw_call(channel, PUSH, chunks, timeout=60)
                if code != grpc.StatusCode.FAILED_PRECONDITION:
                    break
            return code, chunks

        async def attack():
            codes = []
            # Mallory (valid certificate, not in the run) claims to be worker-1, before and during rounds;
            # each push waits, unread, for worker-0's order, which names worker-1: refused.
            for _ in range(2):
                codes.append((await judged_push(mallory))[0])
            # worker-0 is not worker-0's designated sender either, even with the run's own certificate
            code, chunks = await judged_push(credentials(pki_dir, "worker-0"))
            codes.append(code)
            # and the server is not a worker: a worker certificate of the run cannot pose as its server
            async with open_channel(target, impostor, server_name="mdgan-server") as channel:
                codes.append(await raw_call(channel, PUSH, chunks, timeout=10))
            return codes

        codes = asyncio.run(attack())
        assert server.wait(180) == 0, server.log()
        for w in workers:
            assert w.wait(60) == 0, w.log()
    finally:
        for p in [server, *workers]:
            p.kill()
    assert codes[:3] == [grpc.StatusCode.PERMISSION_DENIED] * 3, codes
    assert codes[3] == grpc.StatusCode.UNAVAILABLE  # worker-0's certificate does not name it mdgan-server
    with open(os.path.join(out, "metrics", "worker-0.prom")) as fh:
        assert re.search(r'mdgan_rejected_inputs_total\{reason="sender"\} 3\.0', fh.read())
    swaps = read_jsonl(os.path.join(out, "swaps.jsonl"))
    assert len(swaps) == 20 and all(w["received"] for s in swaps for w in s["workers"].values())
    mdgan_in_process("simulate", *flags, "--dataset", "synthetic", "--no-progress", "--out", str(tmp_path / "sim"))
    assert read_json(os.path.join(out, "summary.json"))["generator_sha256"] == \
        read_json(tmp_path / "sim" / "summary.json")["generator_sha256"]


@pytest.mark.slow
def test_a_private_feedback_site_takes_no_discriminator_in_even_from_a_member(tmp_path, run_pki):
    """--dp-mechanism feedback over the services (mutual TLS, checkpoints, a target epsilon): a push from a
    member of the run, with its own certificate, is refused (FAILED_PRECONDITION) without harm; the run
    swaps nothing, and ends with simulate's generator and each site's epsilon."""
    from mdgan_app.cli import main

    pki_dir, _ = run_pki
    flags = ["--workers", "2", "--iterations", "120", "--seed", "3", "--gan", "gan", "--dp-mechanism", "feedback",
             "--dp-discriminators", "3", "--dp-target-epsilon", "8", "--dp-max-grad-norm", "0.3"]
    out = str(tmp_path / "grpc")
    server, port = start_server(out, *flags, "--checkpoint-every", "50", *tls_flags(pki_dir, "mdgan-server"))
    workers = [start_worker(out, port, i, 2, "--dataset", "synthetic", "--state-dir", str(tmp_path / f"state-{i}"),
                            "--dp-fixed-noise", "2", *tls_flags(pki_dir, f"worker-{i}")) for i in range(2)]
    try:
        target = peer_port(workers[0].log_path)
        wait_for_iterations(server, out, 1)

        async def push() -> grpc.StatusCode:
            chunks = [c.SerializeToString() for c in zeroed_discriminator_chunks(1, "worker-1")]
            async with open_channel(target, credentials(pki_dir, "worker-1"), server_name="worker-0") as channel:
                return await raw_call(channel, PUSH, chunks, timeout=30)

        code = asyncio.run(push())
        assert server.wait(180) == 0, server.log()
        for w in workers:
            assert w.wait(60) == 0, w.log()
    finally:
        for p in [server, *workers]:
            p.kill()
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "takes no discriminators in" in workers[0].log()
    summary = read_json(os.path.join(out, "summary.json"))
    assert summary["swaps"] == 0 and summary["payload_bytes"]["worker_to_worker"] == 0
    assert main(["simulate", *flags, "--dataset", "synthetic", "--no-progress", "--eval-every", "-1",
                 "--dp-fixed-noise", "2", "--out", str(tmp_path / "sim")]) == 0  # (the same noise, to compare)
    simulated = read_json(tmp_path / "sim" / "summary.json")
    assert summary["generator_sha256"] == simulated["generator_sha256"]
    assert summary["privacy"]["sites"] == simulated["privacy"]["sites"]
    assert 7.9 <= summary["privacy"]["epsilon_max"] <= 8.0  # each part answered its planned 40 times


@pytest.mark.slow
def test_a_members_poisoned_push_ahead_of_its_order_is_checked_and_refused(tmp_path, run_pki):
    """A member's own key (a malicious site, or a stolen key) pushes a zeroed discriminator to its
    designated peer for the next round, before the server has ordered it. It is held until the
    order comes, then its content is checked: refused (PERMISSION_DENIED, counted), the receiver
    keeps its own D for that round, and the member's real push is a duplicate. Every other round
    swaps as usual."""
    pki_dir, _ = run_pki
    flags = ["--workers", "2", "--iterations", "40", "--swap-every", "2", "--seed", "3", "--gan", "gan"]
    out = str(tmp_path / "grpc")
    server, port = start_server(out, *flags, "--swap-timeout", "30", *tls_flags(pki_dir, "mdgan-server"))
    workers = [start_worker(out, port, i, 2, "--dataset", "synthetic", *tls_flags(pki_dir, f"worker-{i}"),
                            "--metrics-dump", os.path.join(out, "metrics", f"worker-{i}.prom")) for i in range(2)]
    stolen = credentials(pki_dir, "worker-1")  # with N = 2, worker-1 is worker-0's sender in every round
    try:
        target = peer_port(workers[0].log_path)
        wait_for_iterations(server, out, 1)

        async def push_ahead() -> tuple[grpc.StatusCode, int]:
            for _ in range(8):  # aimed again when the run's rounds raced past it before it arrived
                swap_round = len(read_jsonl(os.path.join(out, "swaps.jsonl"))) + 1
                chunks = [c.SerializeToString() for c in zeroed_discriminator_chunks(swap_round, "worker-1")]
                async with open_channel(target, stolen, server_name="worker-0") as channel:
                    call = channel.stream_unary(PUSH)(timeout=60)
                    try:
                        for chunk in chunks:
                            await call.write(chunk)
                        await call.done_writing()
                    except Exception:  # noqa: BLE001 -- refused while writing; the status says why
                        pass
                    try:
                        await call
                        return grpc.StatusCode.OK, swap_round
                    except grpc.aio.AioRpcError as exc:
                        if exc.code() == grpc.StatusCode.PERMISSION_DENIED:
                            assert exc.details().startswith("discriminator refused: "), exc.details()
                            return exc.code(), swap_round
                        if exc.code() not in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS):
                            return exc.code(), swap_round
            return grpc.StatusCode.DEADLINE_EXCEEDED, -1

        code, attacked = asyncio.run(push_ahead())
        assert server.wait(180) == 0, server.log()
        for w in workers:
            assert w.wait(60) == 0, w.log()
    finally:
        for p in [server, *workers]:
            p.kill()
    assert code == grpc.StatusCode.PERMISSION_DENIED, code
    with open(os.path.join(out, "metrics", "worker-0.prom")) as fh:
        assert re.search(r'mdgan_rejected_inputs_total\{reason="discriminator"\} 1\.0', fh.read())
    swaps = read_jsonl(os.path.join(out, "swaps.jsonl"))
    assert len(swaps) == 20
    for record in swaps:
        receiver = record["workers"]["worker-0"]
        if record["round"] == attacked:  # it kept its own D; worker-1's real push came second
            assert not receiver["received"] and "norm is 0 times ours" in receiver["refused"], record
            # (a duplicate, or after the round closed: too late)
            assert re.search("ALREADY_EXISTS|FAILED_PRECONDITION", record["workers"]["worker-1"]["error"]), record
        else:
            assert all(w["received"] and not w.get("refused") for w in record["workers"].values()), record
    summary = read_json(os.path.join(out, "summary.json"))
    assert summary["swaps_refused"] == 1 and summary["iterations"] == 40


# -- 3. a shard belongs to the identity that first held it -----------------------------------------------

def _join(**fields) -> bytes:
    base = dict(shard_size=1000, peer_address="127.0.0.1:9", sample_shape=[784], num_classes=10)
    base.update(fields)
    return pb.WorkerMessage(join=pb.Join(**base)).SerializeToString()


async def _hold(channel, join: bytes):
    """Join and keep the stream; (call, shard index) or (None, status)."""
    call = channel.stream_stream(TRAIN, response_deserializer=pb.ServerMessage.FromString)(timeout=30)
    await call.write(join)
    try:
        reply = await call.read()
    except grpc.aio.AioRpcError as exc:
        return None, exc.code()
    if reply is grpc.aio.EOF:
        return None, await call.code()
    return call, reply.welcome.shard_index


def test_a_shard_is_bound_to_the_identity_that_first_held_it(run_pki):
    pki_dir, _ = run_pki
    server_tls = credentials(pki_dir, "mdgan-server")
    who = {name: credentials(pki_dir, name) for name in ("worker-0", "worker-1", "mallory", "mdgan-server")}

    async def scenario(authenticated: bool, allowed=None):
        coordinator = Coordinator(TrainingConfig(workers=2, batch_size=10).validate(),
                                  admission=Admission(authenticated, tuple(allowed) if allowed else None))
        server = rpc.make_server(max_receive_bytes=1 << 20)
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(coordinator, server)
        port = (server.add_secure_port("127.0.0.1:0", server_tls.server_credentials()) if authenticated
                else server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        results = {}

        def ch(name):
            return open_channel(port, who[name] if authenticated else None)
        try:
            async with ch("worker-0") as c0, ch("mallory") as cm, ch("worker-1") as c1, ch("mdgan-server") as cs:
                holder, results["worker-0 takes shard 0"] = await _hold(c0, _join(shard_index=0, name="worker-0"))
                _, results["mallory asks for shard 0"] = await _hold(cm, _join(shard_index=0, name="mallory"))
                holder.cancel()
                await asyncio.sleep(0.3)  # worker-0 is gone; shard 0 is still its own
                _, results["mallory asks again"] = await _hold(cm, _join(shard_index=0, name="mallory"))
                _, results["worker-0 asks for shard 1"] = await _hold(c0, _join(shard_index=1, name="worker-0"))
                back, results["worker-0 comes back, assigned"] = await _hold(
                    c0, _join(dataset_size=2000, shard_size=0, name="worker-0"))
                if authenticated:
                    _, results["the server's own certificate"] = await _hold(cs, _join(shard_index=1))
                w1, results["worker-1 takes shard 1"] = await _hold(c1, _join(shard_index=1, name="worker-1"))
                if w1 is not None:  # an admitted worker sending bytes that do not parse: INVALID_ARGUMENT
                    await w1.write(b"\x0a\xff\xff\xff\xff\x0f")
                    try:
                        while await w1.read() is not grpc.aio.EOF:
                            pass
                        results["garbage after the join"] = await w1.code()
                    except grpc.aio.AioRpcError as exc:
                        results["garbage after the join"] = exc.code()
                if back is not None:
                    back.cancel()
        finally:
            await server.stop(None)
        return results

    secure = asyncio.run(scenario(True))
    denied = grpc.StatusCode.PERMISSION_DENIED
    assert secure == {"worker-0 takes shard 0": 0, "mallory asks for shard 0": denied, "mallory asks again": denied,
                      "worker-0 asks for shard 1": denied, "worker-0 comes back, assigned": 0,
                      "the server's own certificate": denied, "worker-1 takes shard 1": 1,
                      "garbage after the join": grpc.StatusCode.INVALID_ARGUMENT}
    # --insecure: the same binding, on the names workers claim (unauthenticated, documented as such)
    plain = asyncio.run(scenario(False))
    assert plain == {k: v for k, v in secure.items() if k != "the server's own certificate"}
    # an allow-list admits only the identities on it
    listed = asyncio.run(scenario(True, allowed=["worker-0", "mallory"]))
    assert listed["worker-1 takes shard 1"] == denied and listed["worker-0 takes shard 0"] == 0
    assert "garbage after the join" not in listed
    assert listed["the server's own certificate"] == denied


# -- 4. hostile input ---------------------------------------------------------------------------------------

def _seeds() -> dict[str, list[bytes]]:
    """Well-formed messages per method, the material the fuzzer mutates."""
    t = codec.encode_tensor(torch.zeros(10, 784))
    worker = [pb.WorkerMessage(join=pb.Join(shard_index=1, shard_size=1000, peer_address="127.0.0.1:9",
                                            sample_shape=[784], num_classes=10, name="fuzz")),
              pb.WorkerMessage(feedback=pb.Feedback(iteration=1, gradient=t)),
              pb.WorkerMessage(heartbeat=pb.Heartbeat(unix_ms=1)),
              pb.WorkerMessage(swap_report=pb.SwapReport(round=1, sent=True))]
    chunks = zeroed_discriminator_chunks(1, "worker-1")
    return {TRAIN: [m.SerializeToString() for m in worker],
            PUSH: [chunks[0].SerializeToString(), chunks[1].SerializeToString()[:4096]],
            CHECK: [health_pb2.HealthCheckRequest(service="mdgan.v1.Peer").SerializeToString()],
            REFLECT: [b"\x1a\x0emdgan.v1.Peer"]}


def _absurd(rng: random.Random) -> bytes:
    """Well-formed protobuf with absurd contents: huge shapes, counts and strings, unknown fields."""
    shape = [rng.choice([2 ** 40, -1, 0, 2 ** 62]) for _ in range(rng.randint(1, 40))]
    tensor = tensor_pb2.Tensor(shape=shape, dtype=rng.randint(0, 50), data=b"\0" * rng.randint(0, 64))
    choice = rng.randrange(4)
    if choice == 0:
        return pb.WorkerMessage(feedback=pb.Feedback(iteration=2 ** 63, gradient=tensor)).SerializeToString()
    if choice == 1:
        return pb.WorkerMessage(join=pb.Join(shard_index=2 ** 31, shard_size=2 ** 63, sample_shape=shape,
                                             peer_address="x" * 5000, name="\u2603" * 300)).SerializeToString()
    if choice == 2:
        spec = tensor_pb2.TensorSpec(name="stack.0.weight", shape=shape, dtype=1)
        return peer_pb2.DiscriminatorChunk(header=peer_pb2.DiscriminatorHeader(
            round=rng.choice([0, 1, 2, 2 ** 63]), tensors=[spec] * rng.randint(1, 500),
            total_bytes=2 ** 63)).SerializeToString()
    return b"\xf8\x07" + bytes([rng.randrange(128)])  # field 127 (no such field, no such oneof member)


def _mutate(rng: random.Random, seed: bytes) -> bytes:
    kind = rng.randrange(5)
    if kind == 0:
        return rng.randbytes(rng.randint(0, 300))
    if kind == 1:
        return seed[:rng.randint(0, max(0, len(seed) - 1))]
    if kind == 2:
        data = bytearray(seed)
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(data) * 8) if data else 0
            if data:
                data[i // 8] ^= 1 << (i % 8)
        return bytes(data)
    if kind == 3:
        return _absurd(rng)
    return seed + rng.randbytes(rng.randint(1, 40))


async def _fuzz(ports: dict[str, int], who: TLSConfig | None, ca: bytes, calls: int, seed: int) -> dict:
    """`calls` malformed calls spread over both services' methods; the count of every final status."""
    rng = random.Random(seed)
    seeds = _seeds()
    counts: dict[str, int] = {}
    targets = [("server", TRAIN), ("server", CHECK), ("server", REFLECT), ("worker", PUSH), ("worker", CHECK),
               ("worker", REFLECT)]
    names = {"server": "mdgan-server", "worker": "worker-0"}
    channels = {role: open_channel(port, who, server_name=names[role], ca=None if who else ca)
                for role, port in ports.items()}
    try:
        for start in range(0, calls, 50):
            batch = []
            for _ in range(min(50, calls - start)):
                role, method = rng.choice(targets)
                messages = [_mutate(rng, rng.choice(seeds[method])) for _ in range(rng.randint(1, 3))]
                batch.append(raw_call(channels[role], method, messages, timeout=5, unary=method == CHECK))
            for code in await asyncio.gather(*batch):
                counts[code.name] = counts.get(code.name, 0) + 1
    finally:
        for channel in channels.values():
            await channel.close()
    return counts


@pytest.mark.slow
def test_thousands_of_malformed_messages_get_no_unknown_and_no_traceback(tmp_path, run_pki):
    pki_dir, rogue_dir = run_pki
    out = str(tmp_path / "grpc")
    flags = ["--workers", "2", "--iterations", "6", "--swap-every", "2", "--gan", "gan", "--swap-timeout", "5",
             "--allowed-workers", "worker-0,worker-1"]
    server, port = start_server(out, *flags, *tls_flags(pki_dir, "mdgan-server"))
    workers = [start_worker(out, port, 0, 2, "--dataset", "synthetic", *tls_flags(pki_dir, "worker-0"))]
    try:
        ports = {"server": port, "worker": peer_port(workers[0].log_path)}
        workers[0].wait_for_log(" as worker-0", 120)  # worker-0 in the run; the server waits for worker-1
        fuzzer = credentials(pki_dir, "mallory")
        ca = fuzzer.ca
        with_cert = asyncio.run(_fuzz(ports, fuzzer, ca, 2000, seed=1))
        without_cert = asyncio.run(_fuzz(ports, None, ca, 150, seed=2))
        rogue = asyncio.run(_fuzz(ports, credentials(rogue_dir, "worker-1"), ca, 150, seed=3))
        healthy = [asyncio.run(health_status(ports["server"], credentials(pki_dir, "worker-1"))),
                   asyncio.run(health_status(ports["worker"], credentials(pki_dir, "worker-1"), "worker-0"))]
        # a run afterwards completes, with the fuzzed worker in it
        workers.append(start_worker(out, port, 1, 2, "--dataset", "synthetic", *tls_flags(pki_dir, "worker-1")))
        assert server.wait(180) == 0, server.log()
        for w in workers:
            assert w.wait(60) == 0, w.log()
    finally:
        for p in [server, *workers]:
            p.kill()
    print("statuses with a valid certificate:", with_cert)
    assert sum(with_cert.values()) == 2000 and "UNKNOWN" not in with_cert, with_cert
    assert with_cert.get("INVALID_ARGUMENT", 0) > 500, with_cert
    assert without_cert == {"UNAVAILABLE": 150} and rogue == {"UNAVAILABLE": 150}, (without_cert, rogue)
    assert healthy == [health_pb2.HealthCheckResponse.SERVING] * 2
    for p in [server, *workers]:
        with open(p.log_path) as fh:
            log = fh.read()
        assert "Traceback" not in log, log[-3000:]
        # bad input is logged, rate-limited: a handful of lines for thousands of calls
        assert log.count("malformed request") < 50, p.name
    summary = read_json(os.path.join(out, "summary.json"))
    assert summary["iterations"] == 6 and summary["workers_alive"] == 2 and summary["swaps"] == 3


# -- provisioning -----------------------------------------------------------------------------------------

def test_mdgan_certs_makes_a_ca_and_named_certificates(tmp_path, capsys):
    from cryptography import x509

    from mdgan_app.cli import main

    def certs(*args):
        try:
            code = main(["certs", *args])
        except SystemExit as exc:  # argparse's error()
            code = exc.code
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out, err)

    d = str(tmp_path / "pki")
    assert certs("init", d).returncode == 0
    assert certs("init", d).returncode != 0  # never silently replaces a CA
    assert certs("issue", d, "mdgan-server", "--server", "--san", "server.example.org", "--san", "10.0.0.7"
                 ).returncode == 0
    result = certs("issue", d, "site-a")
    assert result.returncode == 0 and "--tls-cert" in result.stdout
    bad = certs("issue", d, "no spaces please")
    assert bad.returncode != 0 and "not a usable identity" in bad.stderr
    assert certs("issue", str(tmp_path / "nowhere"), "x").returncode != 0

    for name, role, sans in (("mdgan-server", pki.ROLE_SERVER,
                              ["mdgan-server", "localhost", "server.example.org", "127.0.0.1", "::1", "10.0.0.7"]),
                             ("site-a", pki.ROLE_WORKER, ["site-a"])):
        paths = pki.identity_paths(d, name)
        pem = open(paths["cert"], "rb").read()
        assert pki.identity_of(pem) == (name, role)
        assert sorted(pki.certificate_names(pem)[1]) == sorted(sans)
        ca = x509.load_pem_x509_certificate(open(paths["ca"], "rb").read())
        x509.load_pem_x509_certificate(pem).verify_directly_issued_by(ca)
        assert oct(os.stat(paths["key"]).st_mode & 0o777) == "0o600"
    assert oct(os.stat(os.path.join(d, "ca.key")).st_mode & 0o777) == "0o600"
