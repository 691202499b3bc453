"""The wire under bad input: real grpc.aio servers on loopback, raw clients sending garbage."""

from __future__ import annotations

import asyncio
import os
import socket

import grpc
import pytest
import torch

from mdgan import compression
from mdgan.config import DataConfig, TrainingConfig
from mdgan.data import load_shard
from mdgan.algorithms.mdgan.swapcheck import SwapCheck, check_incoming
from mdgan.attacks import SWAP_ATTACKS, DiscriminatorAttack
from mdgan.gan import DiscriminatorSide, GeneratorSide
from services.common import codec, rpc
from services.common.proto import coordinator_pb2 as pb
from services.common.proto import coordinator_pb2_grpc, peer_pb2, peer_pb2_grpc
from services.server.coordinator import Coordinator, Deadlines
from services.worker.algorithms.mdgan import MDGANWorker
from services.worker.node import ServerLink, WorkerData, WorkerNode
from services.worker.peer import PeerServicer, push_discriminator

from procs import read_json, read_jsonl, start_server, start_worker

B = 10
INVALID_ARGUMENT = 3


def _join(**fields) -> pb.WorkerMessage:
    base = dict(shard_size=1000, peer_address="127.0.0.1:9", sample_shape=[784], num_classes=10)
    base.update(fields)
    return pb.WorkerMessage(join=pb.Join(**base))


def _bad_feedback(iteration: int) -> list[pb.Tensor]:
    good = torch.zeros(B, 784)
    if iteration == 1:
        return [codec.encode_tensor(torch.zeros(B, 783))]  # wrong shape
    if iteration == 2:
        return [codec.encode_tensor(torch.full((B, 784), float("nan")))]  # NaN
    if iteration == 3:
        # oversized, yet under the server's message bound (sized to the model: a bigger message ends the
        # stream with RESOURCE_EXHAUSTED before any code of ours sees it)
        return [codec.encode_tensor(torch.zeros(20 * B, 784))]
    if iteration == 4:
        t = codec.encode_tensor(good)
        t.data += b"\0" * 4096  # more bytes than the shape says
        return [t]
    if iteration == 5:
        return [codec.encode_tensor(good.double())]  # wrong dtype
    if iteration == 7:
        return [codec.encode_tensor(good), codec.encode_tensor(good)]  # a duplicate answer
    return [codec.encode_tensor(good)]


async def _fake_worker(port: int):
    """Joins as shard 1, answers with malformed feedback for a few iterations, then behaves."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = coordinator_pb2_grpc.CoordinatorStub(channel).Train(timeout=120)
        await call.write(_join(shard_index=1))
        welcome = await asyncio.wait_for(call.read(), 60)
        iterations, rejections, stop = [], [], None
        while stop is None:
            message = await asyncio.wait_for(call.read(), 60)
            assert message is not grpc.aio.EOF
            kind = message.WhichOneof("body")
            if kind == "batches":
                t = message.batches.iteration
                iterations.append(t)
                for gradient in _bad_feedback(t):
                    await call.write(pb.WorkerMessage(feedback=pb.Feedback(iteration=t, gradient=gradient)))
            elif kind == "rejection":
                rejections.append(message.rejection)
            elif kind == "stop":
                stop = message.stop.reason
        await call.done_writing()
        return welcome, iterations, rejections, stop


@pytest.mark.slow
def test_malformed_feedback_is_answered_with_invalid_argument_and_training_goes_on(tmp_path):
    out = str(tmp_path)
    server, port = start_server(out, "--workers", "2", "--iterations", "10", "--swap-every", "1000",
                                "--batch-size", str(B), "--peer-check", "off")  # the fake worker serves no Peer
    worker = start_worker(out, port, 0, 2, "--dataset", "synthetic")
    try:
        welcome, iterations, rejections, stop = asyncio.run(_fake_worker(port))
        assert server.wait(60) == 0, server.log()
        assert worker.wait(30) == 0, worker.log()
    finally:
        server.kill()
        worker.kill()
    assert welcome.welcome.worker_id == "worker-1"
    assert iterations == list(range(1, 11)) and stop == "run finished"
    assert [r.code for r in rejections] == [INVALID_ARGUMENT] * 6
    assert [(r.iteration, r.reason) for r in rejections] == [
        (1, "shape"), (2, "nonfinite"), (3, "size"), (4, "size"), (5, "dtype"), (7, "iteration")]
    summary = read_json(os.path.join(out, "summary.json"))
    assert summary["iterations"] == 10 and summary["workers_alive"] == 2 and summary["rejections"] == 5
    history = read_jsonl(os.path.join(out, "history.jsonl"))
    assert [r["answered"] for r in history] == [1] * 5 + [2] * 5
    with open(os.path.join(out, "metrics", "server.prom")) as fh:
        exposition = fh.read()
    for reason, count in (("shape", 1), ("nonfinite", 1), ("size", 2), ("dtype", 1), ("iteration", 1)):
        assert f'mdgan_rejected_inputs_total{{reason="{reason}"}} {count}.0' in exposition
    assert [r["rejected"] for r in history] == [1] * 5 + [0] * 5


async def _serve(servicer_adder) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(options=rpc.options())
    servicer_adder(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


async def _push(port: int, chunks) -> tuple[grpc.StatusCode, object]:
    """Push a discriminator's chunks to a Peer service on loopback: (OK, the PushAck), or (the refusal's
    status, its details)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            return grpc.StatusCode.OK, await push_discriminator(channel, chunks, 10)
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details()


async def _join_status(port: int, first: pb.WorkerMessage) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = coordinator_pb2_grpc.CoordinatorStub(channel).Train(timeout=10)
        try:
            # (a server that refuses the stream as it opens can end the call before this write lands)
            await call.write(first)
            reply = await call.read()
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        if reply is grpc.aio.EOF:
            return await call.code()
        call.cancel()
        return grpc.StatusCode.OK


def test_bad_joins_get_the_right_status():
    async def scenario():
        config = TrainingConfig(workers=2, batch_size=B).validate()
        coordinator = Coordinator(config)
        server, port = await _serve(lambda s: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(coordinator, s))
        try:
            codes = {
                "not a join": await _join_status(port, pb.WorkerMessage(heartbeat=pb.Heartbeat())),
                "shard out of range": await _join_status(port, _join(shard_index=7)),
                "wrong sample shape": await _join_status(port, _join(shard_index=0, sample_shape=[100])),
                "shard smaller than a batch": await _join_status(port, _join(shard_index=0, shard_size=3)),
                "no peer address": await _join_status(port, _join(shard_index=0, peer_address="")),
            }
            # a worker that holds shard 0; a second one for shard 0 is refused
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                holder = coordinator_pb2_grpc.CoordinatorStub(channel).Train(timeout=10)
                await holder.write(_join(shard_index=0))
                assert (await holder.read()).WhichOneof("body") == "welcome"
                codes["duplicate shard"] = await _join_status(port, _join(shard_index=0))
                # a worker without a shard index gets the free shard 1; then none is left
                assigned = coordinator_pb2_grpc.CoordinatorStub(channel).Train(timeout=10)
                await assigned.write(_join(dataset_size=2000, shard_size=0))
                assign = (await assigned.read()).welcome
                codes["all shards taken"] = await _join_status(port, _join(dataset_size=2000, shard_size=0))
                holder.cancel()
                assigned.cancel()
            return codes, assign
        finally:
            await server.stop(None)

    codes, assign = asyncio.run(scenario())
    assert assign.shard_index == 1 and assign.worker_id == "worker-1"
    assert codes == {
        "not a join": grpc.StatusCode.INVALID_ARGUMENT,
        "shard out of range": grpc.StatusCode.INVALID_ARGUMENT,
        "wrong sample shape": grpc.StatusCode.INVALID_ARGUMENT,
        "shard smaller than a batch": grpc.StatusCode.INVALID_ARGUMENT,
        "no peer address": grpc.StatusCode.INVALID_ARGUMENT,
        "duplicate shard": grpc.StatusCode.ALREADY_EXISTS,
        "all shards taken": grpc.StatusCode.RESOURCE_EXHAUSTED,
    }


def test_joins_beyond_those_in_progress_are_told_to_retry_and_a_worker_does(caplog):
    # 300 workers of `mdgan local` used to open more than MAX_PENDING_JOINS streams at once; the
    # extra ones were refused for good (RESOURCE_EXHAUSTED) and the run stopped.
    from services.server.coordinator import MAX_PENDING_JOINS

    config = TrainingConfig(workers=2, batch_size=B).validate()
    shard = load_shard(DataConfig("synthetic", num_shards=2), 0)

    async def scenario():
        coordinator = Coordinator(config)
        server, port = await _serve(lambda s: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(coordinator, s))
        node = WorkerNode(ServerLink(f"127.0.0.1:{port}", connect_timeout=60), WorkerData(shard=shard),
                          advertise_address="127.0.0.1:9")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = coordinator_pb2_grpc.CoordinatorStub(channel)
                held = [stub.Train(timeout=30) for _ in range(MAX_PENDING_JOINS)]  # open, never a join
                for _ in range(200):
                    if coordinator._pending_joins == MAX_PENDING_JOINS:
                        break
                    await asyncio.sleep(0.05)
                assert coordinator._pending_joins == MAX_PENDING_JOINS
                refused = await _join_status(port, _join(shard_index=1))
                joining = asyncio.create_task(node.run())
                while "too many joins in progress" not in caplog.text:  # refused, and retrying
                    assert not joining.done(), joining
                    await asyncio.sleep(0.05)
                for call in held:
                    call.cancel()
                for _ in range(400):  # admitted once the others went
                    if coordinator.workers:
                        break
                    assert not joining.done(), joining
                    await asyncio.sleep(0.05)
                joined = sorted(coordinator.workers)
                joining.cancel()
                await asyncio.gather(joining, return_exceptions=True)
                return refused, joined
        finally:
            await server.stop(None)

    with caplog.at_level("WARNING", logger="mdgan.worker"):
        refused, joined = asyncio.run(scenario())
    assert refused == grpc.StatusCode.UNAVAILABLE
    assert joined == [0]


def test_an_answer_to_a_stream_the_server_has_ended_is_a_broken_stream():
    # A worker paused past its deadline (SIGSTOP, a frozen VM) steps, when it wakes, on the batch it
    # had, and answers on a stream the server ended meanwhile. grpc.aio raises InvalidStateError for
    # that; it ended the worker with a traceback, where a broken stream makes it rejoin.
    from services.worker.algorithms.base import StreamBroken

    class EndsAtOnce(coordinator_pb2_grpc.CoordinatorServicer):
        async def Train(self, request_iterator, context):
            context.set_code(grpc.StatusCode.UNAVAILABLE)
            context.set_details("dropped")

    shard = load_shard(DataConfig("synthetic", num_shards=2), 0)

    async def scenario():
        server, port = await _serve(lambda s: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(EndsAtOnce(), s))
        node = WorkerNode(ServerLink(f"127.0.0.1:{port}"), WorkerData(shard=shard), advertise_address="127.0.0.1:9")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = coordinator_pb2_grpc.CoordinatorStub(channel).Train(timeout=10)
                assert await call.code() == grpc.StatusCode.UNAVAILABLE  # the stream has ended
                with pytest.raises(StreamBroken, match="the server dropped us or is gone.*UNAVAILABLE dropped"):
                    await node.write(call, pb.WorkerMessage(feedback=pb.Feedback(iteration=3)))
                # A swap's report, written by a task nobody awaits, ends quietly: the read loop reconnects.
                worker = MDGANWorker(node, TrainingConfig(workers=2, batch_size=B).validate(), shard)

                async def swapped(order):
                    return pb.SwapReport(round=order.round, sent=True, received=True)

                worker._swap = swapped
                task = asyncio.create_task(worker.swaps._report_when_done(call, 2, swapped(pb.SwapOrder(round=2))))
                await asyncio.wait_for(task, 10)
                assert task.exception() is None
        finally:
            await server.stop(None)

    asyncio.run(scenario())


def test_a_worker_the_server_drops_mid_run_rejoins_and_only_the_runs_end_ends_it(caplog):
    # Dropped (a missed deadline, a failed swap or checkpoint: each passing), a worker took the stop for
    # the run's end: it exited 0 and stayed out of an elastic run, and no launcher or restart policy saw it.
    config = TrainingConfig(workers=1, batch_size=B).validate()
    shard = load_shard(DataConfig("synthetic", num_shards=1), 0)

    async def joined(coordinator, previous=None):
        for _ in range(400):
            handle = coordinator.workers.get(0)
            if handle is not None and handle is not previous:
                return handle
            await asyncio.sleep(0.05)
        raise AssertionError("the worker did not (re)join")

    async def scenario():
        coordinator = Coordinator(config, deadlines=Deadlines(heartbeat_interval=1))
        server, port = await _serve(lambda s: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(coordinator, s))
        node = WorkerNode(ServerLink(f"127.0.0.1:{port}", connect_timeout=60, server_timeout=60),
                          WorkerData(shard=shard), advertise_address="127.0.0.1:9")
        running = asyncio.create_task(node.run())
        try:
            first = await joined(coordinator)
            coordinator.roster.depart(first)  # as the Trainer drops a worker: off the roster, then told
            await first.stop("missed its deadline")
            second = await joined(coordinator, first)
            assert not running.done()
            await second.stop("run finished")
            return await asyncio.wait_for(running, 30)
        finally:
            running.cancel()
            await server.stop(None)

    with caplog.at_level("INFO", logger="mdgan.worker"):
        outcome = asyncio.run(scenario())
    assert outcome == "run finished"
    assert "the server dropped us before the run's end (missed its deadline); reconnecting" in caplog.text


def test_peer_service_checks_every_pushed_discriminator():
    config = TrainingConfig(workers=2, batch_size=B).validate()
    shard = load_shard(DataConfig("synthetic", num_shards=2), 0)
    node = WorkerNode(ServerLink("127.0.0.1:9"), WorkerData(shard=shard), advertise_address="127.0.0.1:9")
    donor = DiscriminatorSide(config, load_shard(DataConfig("synthetic", num_shards=2), 1))
    state = donor.export_state()

    async def push(chunks) -> tuple[grpc.StatusCode, object]:
        return await _push(port, chunks)

    async def scenario():
        nonlocal port
        server, port = await _serve(lambda s: peer_pb2_grpc.add_PeerServicer_to_server(PeerServicer(node), s))
        try:
            results = {"before joining": await push(list(codec.state_chunks(state, 1, "worker-1")))}
            node.algorithm = MDGANWorker(node, config, shard)  # what the run's welcome builds
            node.algorithm.swaps.mailbox.expect(1, "worker-1")  # the swap order: round 1 comes from worker-1
            good = list(codec.state_chunks(state, 1, "worker-1"))
            wrong = dict(state)
            wrong["stack.4.weight"] = torch.zeros(11, 511)
            poisoned = dict(state)
            poisoned["stack.0.bias"] = torch.full((512,), float("inf"))
            results["wrong layout"] = await push(list(codec.state_chunks(wrong, 1, "worker-1")))
            results["data first"] = await push(good[1:])
            results["truncated"] = await push(good[:-1])
            results["infinite weights"] = await push(list(codec.state_chunks(poisoned, 1, "worker-1")))
            results["unexpected round"] = await push(list(codec.state_chunks(state, 9, "worker-1")))
            results["good"] = await push(good)
            results["same round again"] = await push(good)
            sender, received, refused, _ = await node.algorithm.swaps.mailbox.collect(1, timeout=1)
            assert refused == ""
            return results, sender, received
        finally:
            await server.stop(None)

    port = 0
    results, sender, received = asyncio.run(scenario())
    codes = {k: v[0] for k, v in results.items()}
    assert codes == {
        "before joining": grpc.StatusCode.FAILED_PRECONDITION,
        "wrong layout": grpc.StatusCode.INVALID_ARGUMENT,
        "data first": grpc.StatusCode.INVALID_ARGUMENT,
        "truncated": grpc.StatusCode.INVALID_ARGUMENT,
        "infinite weights": grpc.StatusCode.INVALID_ARGUMENT,
        "unexpected round": grpc.StatusCode.FAILED_PRECONDITION,
        "good": grpc.StatusCode.OK,
        "same round again": grpc.StatusCode.ALREADY_EXISTS,
    }
    assert results["good"][1].received_bytes == 670_219 * 4
    assert sender == "worker-1"
    assert all(torch.equal(received[k], v) for k, v in state.items())


def test_a_late_joiner_whose_donor_left_is_told_and_takes_the_next_copy_attempt():
    # The joiner waited out the swap deadline for a donor that had died (the run standing still for
    # it), then refused every later copy at that boundary as "too old": the server retried with the
    # same number, and the run never passed that boundary.
    config = TrainingConfig(workers=3, batch_size=B).validate()
    shard = load_shard(DataConfig("synthetic", num_shards=3), 1)
    node = WorkerNode(ServerLink("127.0.0.1:9"), WorkerData(shard=shard), advertise_address="127.0.0.1:9")
    state = DiscriminatorSide(config, load_shard(DataConfig("synthetic", num_shards=3), 2)).export_state()

    async def push(swap_round: int, sender: str) -> grpc.StatusCode:
        chunks = list(codec.state_chunks(state, swap_round, sender))
        chunks[0].header.copy = True
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                await push_discriminator(channel, chunks, 10)
                return grpc.StatusCode.OK
            except grpc.aio.AioRpcError as exc:
                return exc.code()

    async def scenario():
        nonlocal port
        server, port = await _serve(lambda s: peer_pb2_grpc.add_PeerServicer_to_server(PeerServicer(node), s))
        node.swap_timeout = 60.0
        worker = node.algorithm = MDGANWorker(node, config, shard)
        worker.swaps.copies.awaiting = True  # the welcome said: wait for a copy
        try:
            first = pb.SwapOrder(round=40, receive_from_worker="worker-0", kind="copy")
            worker.swaps.copies.expect(40, "worker-0")
            waiting = asyncio.create_task(worker.swaps._copy(first))
            await asyncio.sleep(0.1)
            await worker._on_swap_cancel(None, pb.SwapCancel(round=40, sender_worker="worker-0", reason="lost",
                                                            copy=True))
            cancelled = await asyncio.wait_for(waiting, 10)  # at once, not after the 60 s deadline
            late = await push(40, "worker-0")  # that number is spent
            second = pb.SwapOrder(round=41, receive_from_worker="worker-2", kind="copy")
            worker.swaps.copies.expect(41, "worker-2")
            taking = asyncio.create_task(worker.swaps._copy(second))
            pushed = await push(41, "worker-2")
            return cancelled, late, pushed, await asyncio.wait_for(taking, 10), worker.side.export_state()
        finally:
            await server.stop(None)

    port = 0
    cancelled, late, pushed, taken, adopted = asyncio.run(scenario())
    assert not cancelled.received and cancelled.error.startswith("no copy from worker-0: the server called it off")
    assert late == grpc.StatusCode.FAILED_PRECONDITION
    assert pushed == grpc.StatusCode.OK and taken.received and not taken.error
    assert all(torch.equal(adopted[k], v) for k, v in state.items())


async def _fake_flgan_worker(port: int):
    """An FL-GAN worker that sends back a generator of the wrong shape in round 1, then echoes the models."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = coordinator_pb2_grpc.CoordinatorStub(channel).Train(timeout=120)
        await call.write(_join(shard_index=1))
        await asyncio.wait_for(call.read(), 60)  # welcome
        received: dict[str, list] = {}
        rounds, rejections = [], []
        while True:
            message = await asyncio.wait_for(call.read(), 60)
            kind = message.WhichOneof("body")
            if kind == "model_part":
                received.setdefault(message.model_part.model, []).append(message.model_part)
            elif kind == "local_round":
                r = message.local_round
                rounds.append(r.round)
                parts = [p for m in ("generator", "discriminator") for p in received.pop(m)]
                if r.round == 1:  # a generator whose first tensor has another shape
                    header = parts[0].header
                    header.tensors[0].shape[-1] += 1
                for p in parts:
                    await call.write(pb.WorkerMessage(model_part=p))
                stats = [pb.StepStats()] * r.iterations
                await call.write(pb.WorkerMessage(local_round_done=pb.LocalRoundDone(round=r.round, stats=stats)))
            elif kind == "rejection":
                rejections.append(message.rejection)
            elif kind == "stop":
                await call.done_writing()
                return rounds, rejections


@pytest.mark.slow
def test_a_malformed_flgan_model_is_refused_and_the_round_goes_on(tmp_path):
    out = str(tmp_path)
    server, port = start_server(out, "--algorithm", "flgan", "--workers", "2", "--iterations", "6",
                                "--swap-every", "2", "--batch-size", str(B), "--gan", "gan")
    worker = start_worker(out, port, 0, 2, "--dataset", "synthetic")
    try:
        rounds, rejections = asyncio.run(_fake_flgan_worker(port))
        assert server.wait(60) == 0, server.log()
        assert worker.wait(30) == 0, worker.log()
    finally:
        server.kill()
        worker.kill()
    assert rounds == [1, 2, 3]
    assert [(r.iteration, r.code, r.reason) for r in rejections] == [(1, INVALID_ARGUMENT, "shape")]
    summary = read_json(os.path.join(out, "summary.json"))
    assert summary["algorithm"] == "flgan" and summary["iterations"] == 6
    assert summary["workers_alive"] == 2 and summary["rejections"] == 1
    history = read_jsonl(os.path.join(out, "history.jsonl"))
    assert [r["answered"] for r in history] == [1, 1, 2, 2, 2, 2]


def test_each_algorithm_takes_only_its_own_messages():
    """A stream speaks its run's algorithm only: the server answers another algorithm's message with a
    rejection ("protocol") and the stream goes on; the worker modules take disjoint message kinds."""
    config = TrainingConfig(workers=2, batch_size=B).validate()
    foreign = {  # a message of the other algorithm, for a stream of each
        "mdgan": pb.WorkerMessage(model_part=pb.ModelPart(round=1, model="generator", data=b"\0")),
        "flgan": pb.WorkerMessage(feedback=pb.Feedback(iteration=1, gradient=codec.encode_tensor(torch.zeros(B, 784)))),
        "pwgan": pb.WorkerMessage(feedback=pb.Feedback(iteration=1, gradient=codec.encode_tensor(torch.zeros(B, 784)))),
        "psgan": pb.WorkerMessage(local_round_done=pb.LocalRoundDone(round=1)),
    }

    async def scenario(algorithm: str):
        coordinator = Coordinator(config, algorithm=algorithm, model_layouts={})
        server, port = await _serve(lambda s: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(coordinator, s))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = coordinator_pb2_grpc.CoordinatorStub(channel).Train(timeout=10)
                await call.write(_join(shard_index=0))
                welcome = (await call.read()).welcome
                await call.write(foreign[algorithm])
                reply = await call.read()
                await call.write(pb.WorkerMessage(heartbeat=pb.Heartbeat()))
                alive = not coordinator.workers[0].connection.closed.is_set()
                call.cancel()
                return welcome.spec.algorithm, reply, alive
        finally:
            await server.stop(None)

    for algorithm in foreign:
        spec_algorithm, reply, alive = asyncio.run(scenario(algorithm))
        assert spec_algorithm == algorithm
        assert reply.WhichOneof("body") == "rejection", reply
        assert (reply.rejection.code, reply.rejection.reason) == (INVALID_ARGUMENT, "protocol")
        assert alive

    from services.worker.algorithms import ALGORITHMS
    shard = load_shard(DataConfig("synthetic", num_shards=2), 0)
    node = WorkerNode(ServerLink("127.0.0.1:9"), WorkerData(shard=shard), advertise_address="127.0.0.1:9")
    taken = {name: set(cls(node, config, shard).receivers()) for name, cls in ALGORITHMS.items()}
    names = list(taken)
    for i, a in enumerate(names):
        assert taken[a] <= {f.name for f in pb.ServerMessage.DESCRIPTOR.oneofs_by_name["body"].fields}, a
        for b in names[i + 1:]:
            assert not taken[a] & taken[b], (a, b, taken[a] & taken[b])


@pytest.mark.parametrize("entry, given", [
    ("services.server.__main__", None), ("services.worker.__main__", None), ("mdgan_app.preload", None),
    ("services.worker.__main__", ""), ("services.worker.__main__", "-event_engine_client")])
def test_services_choose_the_grpc_io_engine_before_grpc_starts(entry, given):
    """Every service's entry point sets GRPC_EXPERIMENTS (the polling engine: one thread hand-off
    less per message) before grpc is imported, since gRPC core reads it only then; a value the
    user gave, even an empty one, is kept."""
    import subprocess
    import sys

    import services

    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    if given is not None:
        env["GRPC_EXPERIMENTS"] = given
    code = ("import builtins, os, sys\n"
            "seen = []\n"
            "real_import = builtins.__import__\n"
            "def spy(name, *a, **k):\n"
            "    if name.split('.')[0] == 'grpc' and 'grpc' not in sys.modules:\n"
            "        seen.append(os.environ.get('GRPC_EXPERIMENTS'))\n"
            "    return real_import(name, *a, **k)\n"
            "builtins.__import__ = spy\n"
            f"import {entry}\n"
            "print(repr(seen[0]))\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(os.path.dirname(__file__)), env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    expected = services.GRPC_EXPERIMENTS if given is None else given
    assert result.stdout.strip().splitlines()[-1] == repr(expected)


def test_workers_sharing_a_process_step_together_then_answer_together():
    """With --workers-per-process, the batches of one iteration reach a process together. Its
    workers decode all of them, then run all their steps, then write all their feedback: each phase
    back to back, its code warm (docs/PERFORMANCE.md), not message code and torch
    interleaved worker by worker."""
    config = TrainingConfig(workers=2, batch_size=B).validate()
    events: list[tuple[str, int]] = []

    class RecordingCall:  # the worker's end of the Session stream
        def __init__(self, index: int):
            self.index = index

        async def write(self, message):
            assert message.WhichOneof("body") == "feedback"
            events.append(("write", self.index))

    samples = codec.encode_tensor(torch.zeros(B, 784))
    labels = codec.encode_tensor(torch.zeros(B, dtype=torch.int64))
    batches = pb.Batches(iteration=1, generated=samples, discriminated=samples, generated_labels=labels,
                         discriminated_labels=labels)

    workers = []
    for index in range(2):
        shard = load_shard(DataConfig("synthetic", num_shards=2), index)
        node = WorkerNode(ServerLink("127.0.0.1:9"), WorkerData(shard=shard), advertise_address="127.0.0.1:9")
        worker = MDGANWorker(node, config, shard)
        step = worker.side.step

        def recorded_step(batch, step=step, index=index):
            events.append(("step", index))
            return step(batch)

        worker.side.step = recorded_step
        workers.append(worker)

    async def iteration():
        await asyncio.gather(*(w._on_batches(RecordingCall(i), batches) for i, w in enumerate(workers)))

    asyncio.run(iteration())
    assert events == [("step", 0), ("step", 1), ("write", 0), ("write", 1)]
    assert all(w.trained_iteration == 1 for w in workers)


@pytest.mark.parametrize("attack", SWAP_ATTACKS)
def test_a_poisoned_discriminator_from_the_designated_sender_is_refused_and_the_round_closed(attack):
    """The sender is the one the order names (a member, or its stolen key), and the state is well
    formed: only the content check can tell. Refused (PERMISSION_DENIED, counted), the receiver keeps
    its own D, and a second push for that round (say, the member's real one) is a duplicate."""
    config = TrainingConfig(workers=2, batch_size=B).validate()
    shard = load_shard(DataConfig("synthetic", num_shards=2), 0)
    node = WorkerNode(ServerLink("127.0.0.1:9"), WorkerData(shard=shard), advertise_address="127.0.0.1:9")
    donor = DiscriminatorSide(config, load_shard(DataConfig("synthetic", num_shards=2), 1))
    honest = donor.export_state()
    poisoned = DiscriminatorAttack(attack, config.seed, 1)(honest)

    async def push(state) -> tuple[grpc.StatusCode, object]:
        return await _push(port, list(codec.state_chunks(state, 1, "worker-1")))

    async def scenario():
        nonlocal port
        server, port = await _serve(lambda s: peer_pb2_grpc.add_PeerServicer_to_server(PeerServicer(node), s))
        try:
            node.algorithm = MDGANWorker(node, config, shard)
            own = {k: v.clone() for k, v in node.algorithm.side.discriminator.state_dict().items()}
            node.algorithm.swaps.mailbox.expect(1, "worker-1")
            results = [await push(poisoned), await push(honest)]
            return results, await node.algorithm.swaps.mailbox.collect(1, timeout=1), own
        finally:
            await server.stop(None)

    port = 0
    before = node.telemetry.rejected.labels("discriminator")._value.get()
    results, (sender, received, refused, _), own = asyncio.run(scenario())
    assert results[0][0] == grpc.StatusCode.PERMISSION_DENIED and results[0][1].startswith("discriminator refused: ")
    assert results[1][0] == grpc.StatusCode.ALREADY_EXISTS
    assert (sender, received) == ("worker-1", None) and refused and refused in results[0][1]
    assert node.telemetry.rejected.labels("discriminator")._value.get() == before + 1
    after = node.algorithm.side.discriminator.state_dict()
    assert all(torch.equal(own[k], after[k]) for k in own)  # it kept its own


def test_the_swap_check_passes_honest_discriminators_and_refuses_each_attack():
    """On a D trained a little: its peers' honest states pass, every swap attack and a NaN fail."""
    config = TrainingConfig(workers=2, batch_size=B, seed=1).validate()
    sides = [DiscriminatorSide(config, load_shard(DataConfig("synthetic", num_shards=2), i)) for i in range(2)]
    generator = GeneratorSide(config)
    for _ in range(30):
        batches = generator.generate(1)
        for side in sides:
            side.step(batches.for_worker(0))
    check = SwapCheck()
    assert check_incoming(sides[0], sides[1].export_state(), check).refused == ""
    assert check_incoming(sides[1], sides[0].export_state(), check).refused == ""
    for attack in SWAP_ATTACKS:
        verdict = check_incoming(sides[0], DiscriminatorAttack(attack, 0, 1)(sides[1].export_state()), check)
        assert verdict.refused, attack
    broken = sides[1].export_state()
    next(iter(broken.values()))[0] = float("nan")
    assert "not finite" in check_incoming(sides[0], broken, check).refused


def test_a_push_that_finds_its_peer_unreachable_is_tried_again_until_the_peer_is_up(caplog):
    """A push failing with UNAVAILABLE (a link down, a peer restarting, a cached channel whose
    connection broke) is tried again on a fresh channel within the swap deadline, and arrives whole;
    the swap round no longer waits out a deadline for it (docs/results/stragglers/README.md, the 121 s round)."""
    config = TrainingConfig(workers=2, batch_size=B).validate()
    shards = [load_shard(DataConfig("synthetic", num_shards=2), i) for i in range(2)]
    receiver_node = WorkerNode(ServerLink("127.0.0.1:9"), WorkerData(shard=shards[0]), advertise_address="127.0.0.1:9")
    sender_node = WorkerNode(ServerLink("127.0.0.1:9"), WorkerData(shard=shards[1]), advertise_address="127.0.0.1:9")
    sender_node.worker_id = sender_node.identity = "worker-1"
    sender_node.swap_timeout = 20.0
    with socket.socket() as probe:  # a port nothing listens on yet
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    async def scenario():
        receiver_node.algorithm = MDGANWorker(receiver_node, config, shards[0])
        receiver_node.algorithm.swaps.mailbox.expect(1, "worker-1")
        sender = MDGANWorker(sender_node, config, shards[1])
        state = compression.pack_state(sender.side.export_state(), "float32")
        order = pb.SwapOrder(round=1, send_to_worker="worker-0", send_to_address=f"127.0.0.1:{port}")
        pushing = asyncio.create_task(sender.swaps.pusher.push(order, state))
        await asyncio.sleep(1.5)  # the first tries find nobody
        assert not pushing.done()
        server = grpc.aio.server(options=rpc.options())
        peer_pb2_grpc.add_PeerServicer_to_server(PeerServicer(receiver_node), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        try:
            sent = await asyncio.wait_for(pushing, 20)
            received = await receiver_node.algorithm.swaps.mailbox.collect(1, timeout=1)
        finally:
            await server.stop(None)
            await sender.end_session()
        return sent, received, state

    with caplog.at_level("INFO", logger="mdgan.worker"):
        pushed, (sender, incoming, refused, _), state = asyncio.run(scenario())
    assert "push to worker-0 failed" in caplog.text and "trying again" in caplog.text
    assert pushed.sent and pushed.payload_bytes == 670_219 * 4 and sender == "worker-1" and refused == ""
    assert all(torch.equal(incoming[k], v) for k, v in state.items())
