"""Sites that take no inbound connection: their discriminators come through the server's relay, sealed end to
end between the two sites (services/common/sealing.py, services/server/relay.py, services/worker/relay.py).

The relay is played as an attacker too (tests/faults/relay_attacks.py): it reads what it carries, flips a
byte, and passes an old round's discriminator off as new."""

from __future__ import annotations

import json
import os
import re
import time

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from conftest import REPO
from procs import mdgan, read_json, read_jsonl, start_server, start_worker, tls_flags
from services.common import pki, sealing

FAULTS = os.path.join(REPO, "tests", "faults")


@pytest.fixture(scope="module")
def sites(tmp_path_factory):
    """A run's PKI with two sites, and a second PKI's site (an outsider)."""
    root = tmp_path_factory.mktemp("pki")
    pki.init_ca(str(root / "run"))
    pki.init_ca(str(root / "other"))
    for name in ("site-a", "site-b", "site-c"):
        pki.issue(str(root / "run"), name)
    pki.issue(str(root / "other"), "site-a")
    return root


def _credentials(root, pki_dir: str, name: str) -> tuple[bytes, bytes, bytes]:
    """(ca, cert, key) PEM of `name` in `pki_dir`."""
    paths = pki.identity_paths(str(root / pki_dir), name)
    return tuple(open(paths[what], "rb").read() for what in ("ca", "cert", "key"))


CHUNKS = [b"header: three tensors", b"\x00\x01\x02" * 1000, b"the last bytes of the state"]


def _sealed(root, swap_round=4, copy=False):
    ca, a_cert, a_key = _credentials(root, "run", "site-a")
    _, b_cert, b_key = _credentials(root, "run", "site-b")
    envelope = sealing.new_envelope("site-a", "site-b", swap_round, copy)
    return envelope, sealing.seal(CHUNKS, a_key, b_cert, envelope), (ca, a_cert, b_key)


def _open_all(sealed, envelope, a_cert, b_key):
    opener = sealing.Opener(b_key, a_cert, envelope)
    return [opener.open(s, i == len(sealed) - 1) for i, s in enumerate(sealed)]


def test_only_the_receiver_opens_a_sealed_push_and_the_sender_is_known_by_its_certificate(sites):
    root = sites
    envelope, sealed, (ca, a_cert, b_key) = _sealed(root)
    assert _open_all(sealed, envelope, a_cert, b_key) == CHUNKS
    assert sealing.sender_identity(ca, a_cert) == "site-a"
    for chunk, plain in zip(sealed, CHUNKS):
        assert plain not in chunk
    # another site of the run, or the relay with its own key, cannot open what was sealed for site-b
    for pki_dir, name in (("run", "site-c"), ("other", "site-a")):
        _, _, key = _credentials(root, pki_dir, name)
        with pytest.raises(sealing.SealError, match="does not open"):
            sealing.Opener(key, a_cert, envelope).open(sealed[0], False)
    # a second push of the same state has a key of its own: nothing repeats between the two
    _, b_cert, _ = _credentials(root, "run", "site-b")
    again = sealing.seal(CHUNKS, _credentials(root, "run", "site-a")[2], b_cert, sealing.new_envelope(
        "site-a", "site-b", 4, False))
    assert all(x != y for x, y in zip(sealed, again))


@pytest.mark.parametrize("attack", ["flip", "reorder", "truncate", "other round", "copy", "other receiver",
                                    "other sender"])
def test_a_sealed_push_altered_moved_or_replayed_on_the_way_does_not_open(sites, attack):
    root = sites
    envelope, sealed, (ca, a_cert, b_key) = _sealed(root)
    opened_as = envelope
    if attack == "flip":
        sealed[1] = sealed[1][:10] + bytes([sealed[1][10] ^ 1]) + sealed[1][11:]
    elif attack == "reorder":
        sealed[0], sealed[1] = sealed[1], sealed[0]
    elif attack == "truncate":  # the last chunk dropped: the one before it does not say it is the last
        sealed = sealed[:2]
    elif attack == "other round":
        opened_as = sealing.Envelope("site-a", "site-b", 5, False, envelope.salt)
    elif attack == "copy":
        opened_as = sealing.Envelope("site-a", "site-b", 4, True, envelope.salt)
    elif attack == "other receiver":
        opened_as = sealing.Envelope("site-a", "site-c", 4, False, envelope.salt)
    else:
        opened_as = sealing.Envelope("site-c", "site-b", 4, False, envelope.salt)
    with pytest.raises(sealing.SealError, match="does not open"):
        _open_all(sealed, opened_as, a_cert, b_key)


def test_a_sender_certificate_of_another_pki_or_a_key_that_cannot_agree_is_refused_in_one_line(sites, tmp_path):
    root = sites
    ca, _, _ = _credentials(root, "run", "site-a")
    _, outsider, _ = _credentials(root, "other", "site-a")
    with pytest.raises(sealing.SealError, match="not issued by this run's CA"):
        sealing.sender_identity(ca, outsider)
    with pytest.raises(sealing.SealError, match="not PEM"):
        sealing.sender_identity(ca, b"garbage")
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    _, b_cert, _ = _credentials(root, "run", "site-b")
    with pytest.raises(sealing.SealError, match="must be EC keys"):
        sealing.seal(CHUNKS, rsa_key, b_cert, sealing.new_envelope("x", "site-b", 1, False))


# -- over gRPC, real processes under mutual TLS ----------------------------------------------------------------

RUN = ["--dataset", "synthetic", "--workers", "3", "--iterations", "12", "--batch-size", "10", "--swap-every", "4",
       "--eval-every", "-1", "--seed", "3", "--no-progress"]


def _env(tmp_path, relay: dict, faults=()) -> dict:
    installed = [{"target": "services.server.relay:RelayServicer.forward", "wrap": "relay_attacks:forward"},
                 {"target": "services.worker.relay:relayed_chunks", "wrap": "relay_attacks:plaintext"}, *faults]
    return dict(os.environ, PYTHONPATH=os.pathsep.join([FAULTS, REPO, os.environ.get("PYTHONPATH", "")]),
                MDGAN_TEST_FAULT=json.dumps(installed), MDGAN_TEST_RELAY=json.dumps(relay))


def _records(path) -> list[bytes]:
    data, out = open(path, "rb").read(), []
    while data:
        size = int.from_bytes(data[:4], "little")
        out.append(data[4:4 + size])
        data = data[4 + size:]
    return out


def _generator(out) -> str:
    return read_json(os.path.join(out, "summary.json"))["generator_sha256"]


def _metric(path, name: str) -> dict[str, float]:
    values = {}
    for line in open(path, encoding="utf-8"):
        if line.startswith(name):
            labels, value = line.rsplit(" ", 1)
            values[labels[len(name):]] = float(value)
    return values


@pytest.mark.slow
@pytest.mark.parametrize("relayed, extra", [(1, []), (3, ["--wire-dtype", "int8", "--swap-lag", "1",
                                                          "--swap-check", "on"])])
def test_relayed_sites_train_the_generator_simulate_trains_and_the_relay_sees_no_plaintext(tmp_path, relayed, extra):
    """One site relayed beside two direct ones (a round mixes the paths), then every site relayed with int8
    discriminators, background swaps and checked swaps: the run ends on simulate's generator, bit for bit. What
    the relay forwarded (recorded in the server process) holds no 32-byte piece of any chunk a sender sealed, and
    Prometheus counts the relayed bytes by sending and receiving site."""
    seen, plain = tmp_path / "relay-saw.bin", tmp_path / "plaintext.bin"
    local = mdgan("local", *RUN, *extra, "--relayed", str(relayed), "--out", tmp_path / "local",
                  env=_env(tmp_path, {"record": str(seen), "plaintext": str(plain)}))
    assert local.returncode == 0, local.stderr
    mdgan("simulate", *RUN, *extra, "--out", tmp_path / "sim")
    assert _generator(tmp_path / "local") == _generator(tmp_path / "sim")

    relayed_sites = {f"worker-{i}" for i in range(3 - relayed, 3)}
    log = (tmp_path / "local" / "logs" / "server.log").read_text()
    for i in range(3):
        path = "through the relay" if f"worker-{i}" in relayed_sites else "direct, at 127.0.0.1:"
        assert re.search(rf"worker-{i} joined as .*swaps {path}", log), log
    rounds = read_jsonl(tmp_path / "local" / "swaps.jsonl")
    assert rounds and all(w["sent"] and w["received"] for r in rounds for w in r["workers"].values())

    from services.common.proto import peer_pb2

    forwarded = [peer_pb2.RelayDown.FromString(m) for m in _records(seen)]
    sealed = b"".join(d.chunk.sealed for d in forwarded)
    headers = [d.chunk.header for d in forwarded if d.chunk.WhichOneof("body") == "header"]
    assert {h.receiver_identity for h in headers} == relayed_sites
    assert len(headers) == len(rounds) * relayed
    secrets = _records(plain)
    assert secrets and sum(map(len, secrets)) <= len(sealed)
    for chunk in secrets:
        for start in range(0, max(1, len(chunk) - 32), max(1, len(chunk) // 16)):
            assert chunk[start:start + 32] not in sealed
    counted = _metric(tmp_path / "local" / "metrics" / "server.prom", "mdgan_relayed_bytes_total")
    assert {re.search(r'receiver="([^"]+)"', k).group(1) for k in counted} == relayed_sites
    assert sum(counted.values()) == len(sealed)
    # `mdgan traffic`: Table III holds, and the relay's term: |theta| per relayed push, the sealed bytes forwarded
    # equal to those the senders report
    traffic = mdgan("traffic", tmp_path / "local", "--json")
    report = json.loads(traffic.stdout)
    assert all(r["payload_matches_formula"] for r in report["rows"])
    relay = report["relay"]
    assert relay["relayed_pushes"] == len(headers) and relay["forwarded_matches_reported"]
    assert relay["forwarded_bytes"] == len(sealed)
    assert relay["payload_formula_bytes"] == len(headers) * report["discriminator_bytes"]
    assert 0 < relay["overhead"] < 0.01  # framing and seals: under 1% of the discriminator


@pytest.mark.slow
@pytest.mark.parametrize("attack", ["flip", "replay"])
def test_a_relay_that_alters_or_replays_a_discriminator_is_refused_by_name_and_the_run_goes_on(tmp_path, attack):
    """The relay flips one byte of round 2's push, or passes round 1's push off as round 2's: the receiver opens
    nothing of it, refuses it with DATA_LOSS, keeps its own discriminator, and the run trains to its end; the
    sender's report names the refusal and the other rounds swap."""
    local = mdgan("local", *RUN, "--relayed", "3", "--out", tmp_path / "local",
                  env=_env(tmp_path, {attack: 2}), check=False)
    assert local.returncode == 0, local.stderr
    rounds = {r["round"]: r for r in read_jsonl(tmp_path / "local" / "swaps.jsonl")}
    assert set(rounds) == {1, 2, 3}
    for number in (1, 3):
        assert all(w["sent"] and w["received"] for w in rounds[number]["workers"].values())
    refused = [w for w in rounds[2]["workers"].values() if not w["received"]]
    assert refused, rounds[2]
    errors = " ".join(w["error"] for w in rounds[2]["workers"].values())
    assert "DATA_LOSS" in errors and "does not open" in errors, errors
    logs = "".join((tmp_path / "local" / "logs" / f"worker-{i}.log").read_text() for i in range(3))
    assert "does not open: altered, moved or replayed on the way" in logs
    assert read_json(tmp_path / "local" / "summary.json")["iterations"] == 12
    # the relay forwarded the refused push's sealed bytes, which no sender counts as sent: `mdgan traffic` says so
    traffic = mdgan("traffic", tmp_path / "local", "--json", check=False)
    relay = json.loads(traffic.stdout)["relay"]
    assert traffic.returncode == 1 and relay["forwarded_bytes"] > relay["sealed_reported_bytes"]


@pytest.mark.slow
def test_a_worker_the_server_cannot_dial_is_relayed_when_it_may_be_and_refused_when_it_may_not(tmp_path):
    """--swaps auto (the default): the server cannot reach the advertised Peer address, so it relays the worker
    and both sides say so in one line; the run finishes. --swaps direct: refused, exit 3, told what to do."""
    root = tmp_path / "pki"
    pki.init_ca(str(root))
    for name in ("server", "worker-0", "worker-1"):
        pki.issue(str(root), name, role="server" if name == "server" else "worker")
    out = str(tmp_path / "run")
    common = ["--dataset", "synthetic"]
    server, port = start_server(out, "--workers", "2", "--iterations", "6", "--batch-size", "10", "--swap-every", "3",
                                *tls_flags(str(root), "server"))
    closed = "127.0.0.1:9"  # (nothing listens on the discard port)
    direct = start_worker(out, port, 0, 2, *common, "--swaps", "direct", "--advertise-address", closed,
                          *tls_flags(str(root), "worker-0"), name="refused")
    assert direct.wait(60) == 3
    assert "cannot be reached at '127.0.0.1:9'" in direct.log() and "--swaps auto or relay" in direct.log()
    workers = [start_worker(out, port, 0, 2, *common, "--advertise-address", closed, *tls_flags(str(root), "worker-0")),
               start_worker(out, port, 1, 2, *common, *tls_flags(str(root), "worker-1"))]
    assert server.wait(120) == 0, server.log()
    assert [w.wait(60) for w in workers] == [0, 0]
    assert re.search(r"worker-0 joined as .*swaps through the relay: the server cannot reach its Peer service at "
                     r"127\.0\.0\.1:9", server.log())
    assert "swaps through the server's relay: the server cannot reach its Peer service" in workers[0].log()
    assert all(w["sent"] and w["received"] for r in read_jsonl(os.path.join(out, "swaps.jsonl"))
               for w in r["workers"].values())


def test_relayed_swaps_without_mutual_tls_are_refused_before_anything_starts(tmp_path):
    done = mdgan("local", *RUN, "--relayed", "1", "--insecure", "--out", tmp_path / "x", check=False)
    assert done.returncode == 2 and "--relayed needs mutual TLS" in done.stderr
    assert not (tmp_path / "x").exists()
    done = mdgan("local", *RUN, "--relayed", "4", "--out", tmp_path / "y", check=False)
    assert done.returncode == 2 and "--relayed must be in 0..3" in done.stderr


# -- the relay service alone, over real gRPC: every bad call gets its status, none hangs ---------------------

def _relay_scenario(pki_dir: str, authenticated: bool = True) -> dict[str, object]:
    import asyncio

    import grpc

    from services.common import rpc
    from services.common.proto import peer_pb2, peer_pb2_grpc
    from services.common.telemetry import Telemetry
    from services.common.tls import TLSConfig
    from services.server.relay import RelayServicer

    def who(name):
        paths = pki.identity_paths(pki_dir, name)
        return TLSConfig.load(paths["ca"], paths["cert"], paths["key"])

    header = peer_pb2.RelayedChunk(header=peer_pb2.RelayHeader(receiver_identity="worker-1", sender_identity="worker-0",
                                                               round=1))
    sealed = peer_pb2.RelayedChunk(sealed=b"\x01" * 100, last=True)

    async def push(channel, messages, timeout=10.0):
        call = peer_pb2_grpc.RelayStub(channel).Push(timeout=timeout)
        try:
            for m in messages:
                await call.write(m)
            await call.done_writing()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass
        try:
            await call
            return "OK"
        except grpc.aio.AioRpcError as exc:
            return f"{exc.code().name}: {exc.details()}"

    async def attach(channel, first=peer_pb2.RelayUp(attach=peer_pb2.RelayAttach())):
        call = peer_pb2_grpc.RelayStub(channel).Attach(timeout=10)
        try:
            await call.write(first)
        except grpc.aio.AioRpcError:
            pass  # refused before the first message went: its read below says how
        return call

    async def scenario():
        telemetry = Telemetry("server")
        # (a member not attached is waited for a moment: a site admitted at this boundary may still be attaching)
        servicer = RelayServicer(telemetry, authenticated, members=lambda: {"worker-0", "worker-1"}, attach_grace=0.5)
        server = rpc.make_server(max_receive_bytes=1 << 21, guard=rpc.HostileInputGuard())
        peer_pb2_grpc.add_RelayServicer_to_server(servicer, server)
        server_tls = who("mdgan-server")
        port = (server.add_secure_port("127.0.0.1:0", server_tls.server_credentials()) if authenticated
                else server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        results = {}

        def channel(name):
            if not authenticated:
                return grpc.aio.insecure_channel(f"127.0.0.1:{port}")
            return grpc.aio.secure_channel(f"127.0.0.1:{port}", who(name).channel_credentials(),
                                           options=[("grpc.ssl_target_name_override", "mdgan-server")])

        try:
            async with channel("worker-0") as w0, channel("worker-1") as w1, channel("mallory") as mallory:
                results["a push to a site not attached"] = await push(w0, [header, sealed])
                if not authenticated:
                    return results
                intruder = await attach(mallory)
                try:
                    await intruder.read()
                except grpc.aio.AioRpcError as exc:
                    results["an outsider attaches"] = exc.code().name
                results["a push as another site"] = await push(w1, [header, sealed])
                results["a push without its header"] = await push(w0, [sealed])
                results["bytes that do not parse"] = (await raw_push(w0)).name
                bad = await attach(w1, peer_pb2.RelayUp(result=peer_pb2.RelayResult(push=1)))
                try:
                    await bad.read()
                except grpc.aio.AioRpcError as exc:
                    results["an attach that does not start with attach"] = exc.code().name
                receiver = await attach(w1)
                for _ in range(50):  # (until the relay has it)
                    if "worker-1" in servicer.attached:
                        break
                    await asyncio.sleep(0.05)

                async def refuse_what_comes():
                    got = await receiver.read()
                    while not (await receiver.read()).chunk.last:
                        pass
                    await receiver.write(peer_pb2.RelayUp(result=peer_pb2.RelayResult(
                        push=got.push, code=grpc.StatusCode.DATA_LOSS.value[0], details="does not open")))

                answering = asyncio.create_task(refuse_what_comes())
                results["the receiver's own answer"] = await push(w0, [header, sealed, sealed, sealed])
                await answering
                results["bytes counted"] = telemetry.relayed_bytes.labels("worker-0", "worker-1")._value.get()

                async def leave_midway():
                    await receiver.read()
                    receiver.cancel()

                leaving = asyncio.create_task(leave_midway())
                results["the receiver leaves mid-push"] = (await push(w0, [header, sealed], timeout=20)).split(":")[0]
                await leaving
                for _ in range(100):  # (until the relay has let it go)
                    if "worker-1" not in servicer.attached:
                        break
                    await asyncio.sleep(0.05)

                async def attach_late_and_take():  # (a site admitted at this boundary, still attaching)
                    await asyncio.sleep(0.2)
                    late = await attach(w1)
                    got = await late.read()
                    while not (await late.read()).chunk.last:
                        pass
                    await late.write(peer_pb2.RelayUp(result=peer_pb2.RelayResult(push=got.push, code=0)))
                    return late

                taking = asyncio.create_task(attach_late_and_take())
                results["a push just before its receiver attaches"] = await push(w0, [header, sealed])
                (await taking).cancel()
        finally:
            await server.stop(None)
        return results

    async def raw_push(channel):
        call = channel.stream_unary("/mdgan.v1.Relay/Push")(timeout=5)
        try:
            await call.write(b"\x0a\xff\xff\xff\xff\x0f")
            await call.done_writing()
        except Exception:  # noqa: BLE001 -- the relay ended the call: its status says why
            pass
        try:
            await call
            return grpc.StatusCode.OK
        except grpc.aio.AioRpcError as exc:
            return exc.code()

    return asyncio.run(scenario())


def test_every_bad_call_to_the_relay_gets_its_status_and_none_hangs(tmp_path):
    pki_dir = str(tmp_path / "pki")
    pki.provision_run(pki_dir, ["worker-0", "worker-1", "mallory"])
    results = _relay_scenario(pki_dir)
    assert results == {
        "a push to a site not attached": "UNAVAILABLE: 'worker-1' is not attached to the relay",
        "an outsider attaches": "PERMISSION_DENIED",
        "a push as another site": "PERMISSION_DENIED: 'worker-1' pushes as 'worker-0'",
        "a push without its header": "INVALID_ARGUMENT: the first message must be the header",
        "bytes that do not parse": "INVALID_ARGUMENT",
        "an attach that does not start with attach": "INVALID_ARGUMENT",
        "the receiver's own answer": "DATA_LOSS: does not open",
        "bytes counted": 300.0,
        "the receiver leaves mid-push": "UNAVAILABLE",
        "a push just before its receiver attaches": "OK"}
    plain = _relay_scenario(pki_dir, authenticated=False)
    assert plain == {"a push to a site not attached": "FAILED_PRECONDITION: the relay needs mutual TLS (relayed swaps "
                                                       "are sealed between the sites' certificates)"}


# -- long steps and idle links ------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_site_whose_steps_hold_it_past_the_liveness_deadline_stays_a_member(tmp_path):
    """worker-1's every step holds its whole process (event loop included) for 3 s, longer than the server's
    liveness deadline (1.5 s): it cannot say anything meanwhile. It owes the step, which --step-timeout bounds,
    so it is not dropped as silent; the run ends with both workers and simulate's generator. Before, it was
    dropped at its first step ("silent for 2 s") and the run went on without it."""
    out = str(tmp_path / "run")
    run = ["--workers", "2", "--iterations", "4", "--batch-size", "10", "--swap-every", "2", "--seed", "5"]
    server, port = start_server(out, *run, "--liveness-timeout", "1.5", "--heartbeat-interval", "0.5",
                                "--step-timeout", "60")
    slow = dict(os.environ, PYTHONPATH=os.pathsep.join([FAULTS, REPO, os.environ.get("PYTHONPATH", "")]),
                MDGAN_TEST_FAULT=json.dumps([{"target": "mdgan.gan:DiscriminatorSide.step",
                                               "wrap": "slow_steps:blocking"}]), MDGAN_TEST_SLOW_STEP="3")
    workers = [start_worker(out, port, 0, 2, "--dataset", "synthetic"),
               start_worker(out, port, 1, 2, "--dataset", "synthetic", env=slow)]
    assert server.wait(180) == 0, server.log()
    assert [w.wait(60) for w in workers] == [0, 0]
    assert "silent" not in server.log() and "dropping" not in server.log(), server.log()
    rows = read_jsonl(os.path.join(out, "history.jsonl"))
    assert [(r["active_workers"], r["answered"]) for r in rows] == [(2, 2)] * 4, rows  # it answered every step
    summary = read_json(os.path.join(out, "summary.json"))
    assert summary["workers_alive"] == 2
    mdgan("simulate", "--dataset", "synthetic", *run, "--eval-every", "-1", "--out", tmp_path / "sim")
    assert summary["generator_sha256"] == _generator(tmp_path / "sim")


@pytest.mark.slow
def test_a_relayed_site_that_joins_late_gets_its_copy_through_the_relay(tmp_path):
    """Churn: worker-1 takes no inbound connection and joins once the run is under way, with no state: the copy of a
    live peer's discriminator it must start from comes through the relay, sealed, and the run finishes with it."""
    root = str(tmp_path / "pki")
    pki.provision_run(root, ["worker-0", "worker-1"])
    out = str(tmp_path / "run")
    server, port = start_server(out, "--workers", "2", "--iterations", "400", "--batch-size", "10", "--swap-every", "5",
                                "--min-workers", "1", *tls_flags(root, "mdgan-server"))
    first = start_worker(out, port, 0, 2, "--dataset", "synthetic", *tls_flags(root, "worker-0"))
    try:
        first.wait_for_log("joined run", 60)
        deadline = time.monotonic() + 60
        while len(read_jsonl(os.path.join(out, "history.jsonl"))) < 2:  # (under way)
            assert time.monotonic() < deadline and server.popen.poll() is None, server.log()
            time.sleep(0.1)
        late = start_worker(out, port, 1, 2, "--dataset", "synthetic", "--swaps", "relay", *tls_flags(root, "worker-1"))
        assert server.wait(180) == 0, server.log()
        assert late.wait(60) == 0 and first.wait(60) == 0
    finally:
        for p in (server, first):
            p.kill()
    assert "took a copy of worker-0's discriminator" in late.log(), late.log()
    active = [r["active_workers"] for r in read_jsonl(os.path.join(out, "history.jsonl"))]
    assert active[0] == 1 and active[-1] == 2, active  # it joined the run under way
    assert re.search(r"worker-1 joined as 'worker-1' .*swaps through the relay", server.log())
    counted = _metric(os.path.join(out, "metrics", "server.prom"), "mdgan_relayed_pushes_total")
    assert counted.get('{outcome="OK"}', 0) >= 1, counted
