"""A worker's or the server's own exception ends in seconds, with its cause: never a silent stall.

The matrix runs the real services (mdgan-server's and mdgan-worker's serve()) in one event loop over
real gRPC, each fault raised inside the real code path by tests/faults/sitecustomize.py's wrapper;
the cases marked slow run them as processes: `mdgan local` (mutual TLS) and the bare services."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import time

import pytest

from conftest import REPO
from faults.sitecustomize import faulty, resolve
from mdgan.roster import Roster, WorkersFailed
from procs import start_server, start_worker

FAULTS = os.path.join(REPO, "tests", "faults")
HANG_GUARD_S = 90  # far below any deadline a stall waits on (a swap deadline, the pause and join timeouts)


# -- the roster and the one-line causes --------------------------------------------------------
def test_failed_workers_put_a_quorum_out_of_reach_at_once_and_a_rejoin_clears_their_fault():
    roster = Roster(4, min_workers=3, pause_timeout=600)
    handles = [object() for _ in range(4)]
    for slot, handle in enumerate(handles):
        roster.arrive(slot, f"worker-{slot}", handle)
    roster.fault(1, "worker-1", "failed while answering batches: RuntimeError: boom")
    roster.fault(2, "worker-2", "failed while answering batches: RuntimeError: boom")
    roster.fault(3, "worker-3", "failed while swapping (round 1): ValueError: other")
    for handle in handles[1:]:
        roster.depart(handle)
    assert roster.failures() == ("worker-1, worker-2 failed while answering batches: RuntimeError: boom; "
                                 "worker-3 failed while swapping (round 1): ValueError: other")

    async def waits() -> tuple[bool, float]:
        started = time.monotonic()
        reached = await roster.wait_for(3, 600)
        return reached, time.monotonic() - started

    reached, waited = asyncio.run(waits())
    assert reached is False and waited < 60  # 4 slots, 3 of them failed: 3 can never be in
    why = roster.short_of(3, 600)
    assert isinstance(why, WorkersFailed) and "worker-3 failed while swapping" in str(why)
    for slot in (1, 2, 3):
        roster.arrive(slot, f"worker-{slot}", object())  # restarted (fixed) and back: it counts again
    assert roster.faults == {} and roster.failures() == ""
    assert isinstance(roster.short_of(5, 1), TimeoutError)


def test_a_cause_is_one_bounded_line_on_both_ends():
    from services.common.rpc import MAX_CAUSE_CHARS, one_line
    from services.server.connection import clean_line

    cause = one_line(RuntimeError("Expected all tensors to be on the same device\nTraceback (most recent...)\n  x"))
    assert cause == "RuntimeError: Expected all tensors to be on the same device"
    assert len(one_line(ValueError("x" * 10_000))) == MAX_CAUSE_CHARS
    assert one_line(KeyError()) == "KeyError"
    assert clean_line("a\nb\x1b[31mred\tc" + "y" * 1000).startswith("a b [31mred c")
    assert len(clean_line("z" * 10_000)) == MAX_CAUSE_CHARS


def test_a_refusal_to_a_caller_that_already_left_is_not_the_refusers_fault():
    """A receiver refuses a push whose sender has just failed and cancelled: gRPC cannot send the status
    (context.abort raises its internal ExecuteBatchError), and that must not read as the receiver's own
    error (it used to fail the receiver: one worker's fault took a healthy one with it)."""
    import grpc

    from services.common import rpc

    async def scenario():
        outcome = asyncio.get_running_loop().create_future()

        async def refuse_after_the_caller_left(context, gone):
            await gone.wait()
            try:
                await rpc.refuse(context, grpc.StatusCode.FAILED_PRECONDITION, "round 1 is not expected")
            except BaseException as exc:
                outcome.set_result(exc)

        async def push(request_iterator, context):
            gone = asyncio.Event()
            context.add_done_callback(lambda _: gone.set())
            # (shielded: the refusal runs after gRPC ended the call, as when it races the caller's cancel)
            await asyncio.shield(asyncio.ensure_future(refuse_after_the_caller_left(context, gone)))

        server = grpc.aio.server()
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.T", {
            "Push": grpc.stream_unary_rpc_method_handler(push)})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = channel.stream_unary("/t.T/Push", request_serializer=bytes, response_deserializer=bytes)()
                await call.write(b"header")
                await asyncio.sleep(0.2)
                call.cancel()
            return await asyncio.wait_for(outcome, 10)
        finally:
            await server.stop(None)

    raised = asyncio.run(scenario())
    assert isinstance(raised, rpc.CallerGone), repr(raised)
    assert "FAILED_PRECONDITION: round 1 is not expected" in str(raised)


# -- the services in one event loop ------------------------------------------------------------
WORKERS = 3


def _server_args(out, *flags):
    from services.server.__main__ import build_parser

    return build_parser().parse_args([
        "--listen", "127.0.0.1:0", "--port-file", os.path.join(out, "server.port"), "--out", out, "--insecure",
        "--metrics-port", "0", "--dataset", "synthetic", "--workers", str(WORKERS), "--iterations", "12",
        "--swap-every", "4", "--eval-every", "-1", "--step-timeout", "60", "--swap-timeout", "120",
        "--join-timeout", "600", "--peer-check", "off", *flags])


def _worker_args(port: int, index: int, state_dir: str, *flags: str):
    from services.worker.__main__ import build_parser

    return build_parser().parse_args([
        "--server", f"127.0.0.1:{port}", "--listen", "127.0.0.1:0", "--advertise-address", "127.0.0.1",
        "--shard-index", str(index), "--num-shards", str(WORKERS), "--dataset", "synthetic", "--insecure",
        "--metrics-port", "0", "--state-dir", state_dir, "--server-timeout", "120", "--connect-timeout", "60",
        *flags])


async def _run_cluster(out: str, server_flags: list[str], worker_flags=()) -> tuple[int, list[int], float]:
    """(server exit code, each worker's exit code, seconds) of a run of the real services in this loop."""
    from services.server import __main__ as server_main
    from services.worker import __main__ as worker_main

    os.makedirs(out, exist_ok=True)
    started = time.monotonic()
    server = asyncio.ensure_future(server_main.serve(_server_args(out, *server_flags)))
    port_file = os.path.join(out, "server.port")
    while not os.path.exists(port_file):
        if server.done():
            server.result()
        await asyncio.sleep(0.02)
    with open(port_file) as fh:
        port = int(fh.read())
    workers = [asyncio.ensure_future(worker_main.serve(_worker_args(port, i, os.path.join(out, f"state-{i}"),
                                                                    *worker_flags)))
               for i in range(WORKERS)]
    everyone = asyncio.gather(server, *workers, return_exceptions=True)
    try:
        outcomes = await asyncio.wait_for(everyone, HANG_GUARD_S)
    except asyncio.TimeoutError:
        raise AssertionError(f"the run did not end within {HANG_GUARD_S} s: a stall") from None
    seconds = time.monotonic() - started
    server_code = server_main.exit_code(outcomes[0]) if isinstance(outcomes[0], Exception) else 0
    worker_codes = []
    for outcome in outcomes[1:]:
        code = worker_main.exit_code(outcome) if isinstance(outcome, BaseException) else 0
        assert code is not None, f"a worker ended with an unknown exception: {outcome!r}"
        worker_codes.append(code)
    return server_code, worker_codes, seconds


def _inject(monkeypatch, target: str, worker: str | None = None, after: int = 0) -> str:
    """Patch `target` to raise RuntimeError (in `worker` only, from its call after+1 on); the message."""
    owner, name = resolve(target)
    message = f"injected fault in {name}"
    monkeypatch.setattr(owner, name, faulty(getattr(owner, name), {"target": target, "worker": worker,
                                                                   "after": after, "message": message}))
    return message


W = "services.worker.algorithms"
# (case, algorithm flags, target, the worker it fails in (None: all), calls that go through first, where)
WORKER_FAULTS = [
    ("step-one", [], f"{W}.mdgan:MDGANWorker._on_batches", "worker-1", 3, "answering batches"),
    ("step-all", [], "mdgan.gan:DiscriminatorSide.step", None, 6, "answering batches"),
    ("data-all", [], "mdgan.data:ShardSampler.next_batch", None, 6, "answering batches"),
    ("pipeline-step-one", ["--pipeline-depth", "2"], f"{W}.mdgan:MDGANWorker._on_batches", "worker-0", 4,
     "answering batches"),
    ("pipeline-step-all", ["--pipeline-depth", "3"], "mdgan.gan:DiscriminatorSide.step", None, 5, "answering batches"),
    ("dp-step-one", ["--dp-noise-multiplier", "1.0"], f"{W}.mdgan:MDGANWorker._on_batches", "worker-2", 3,
     "answering batches"),
    ("dp-step-all", ["--dp-noise-multiplier", "1.0"], "mdgan.gan:DiscriminatorSide._private_step", None, 6,
     "answering batches"),
    ("swap-one", [], f"{W}.mdgan.swaps:WorkerSwaps._swap", "worker-0", 0, "swapping (round 1)"),
    ("swap-all", [], f"{W}.mdgan.swaps:WorkerSwaps._swap", None, 0, "swapping (round 1)"),
    ("swap-check-all", [], "services.worker.peer:check_incoming", None, 0, "receiving a discriminator"),
    ("swap-install-one", ["--swap-lag", "2"], f"{W}.mdgan.swaps:WorkerSwaps._install", "worker-2", 0,
     "swapping (round 1)"),
    ("swap-install-all", ["--swap-lag", "2"], f"{W}.mdgan.swaps:WorkerSwaps._install", None, 0, "swapping (round 1)"),
    ("checkpoint-one", ["--checkpoint-every", "4"], f"{W}.mdgan:MDGANWorker._save_state", "worker-1", 0,
     "answering checkpoint"),
    ("welcome-all", [], f"{W}.mdgan:MDGANWorker.welcome", None, 0, "setting up the run"),
    ("flgan-round-one", ["--algorithm", "flgan"], f"{W}.flgan:FLGANWorker._on_local_round", "worker-0", 1,
     "answering local_round"),
    ("flgan-round-all", ["--algorithm", "flgan"], f"{W}.flgan:FLGANWorker._on_local_round", None, 0,
     "answering local_round"),
    ("pwgan-round-all", ["--algorithm", "pwgan"], f"{W}.pwgan:PWGANWorker._on_round", None, 3,
     "answering potential_round"),
    ("psgan-round-one", ["--algorithm", "psgan", "--ps-threshold", "2"], f"{W}.psgan:PSGANWorker._on_round",
     "worker-1", 2, "answering replica_round"),
]


@pytest.mark.parametrize("case, flags, target, worker, after, where", WORKER_FAULTS, ids=[c[0] for c in WORKER_FAULTS])
def test_a_workers_own_error_is_told_to_the_server_and_ends_the_run_or_only_that_worker(
        tmp_path, monkeypatch, caplog, case, flags, target, worker, after, where):
    message = _inject(monkeypatch, target, worker, after)
    with caplog.at_level(logging.INFO):
        server_code, worker_codes, _ = asyncio.run(_run_cluster(str(tmp_path / "run"), flags))
    cause = f"failed while {where}: RuntimeError: {message}"
    failing = [f"worker-{i}" for i in range(WORKERS)] if worker is None else [worker]
    server_lines = [r.getMessage() for r in caplog.records if r.name == "mdgan.server"]
    named = [name for name in failing if any(line.startswith(f"{name} {cause}") for line in server_lines)]
    if case == "swap-check-all":  # every receiver's check fails; a worker that fails receiving before it has
        # pushed leaves its own receiver nothing to check, which then goes on alone: some fail, not always all
        assert named, server_lines[-10:]
        assert all(worker_codes[int(n.rsplit("-", 1)[1])] == 1 for n in named), worker_codes
        assert server_code == (1 if len(named) == WORKERS else 0), (server_code, named, server_lines[-5:])
        assert "Traceback" not in "".join(server_lines)
        return
    # the server names each failed worker and its cause (at the start, those it heard before it gave up:
    # the quorum was out of reach as soon as enough of them had failed)
    assert named == failing or (named and server_lines[-1].startswith("the run cannot start")), server_lines[-10:]
    for name in failing:
        assert worker_codes[int(name.rsplit("-", 1)[1])] == 1
    assert "Traceback" not in "".join(server_lines)  # (only the cause crosses the wire)
    if worker is None:  # nobody left: the run stops at once, exit 1, its last line naming them and the error
        assert server_code == 1, server_lines[-5:]
        last = server_lines[-1]  # (all of them, or at start those that had failed when it could not start)
        assert last.startswith(("the run stopped early", "the run cannot start")) and cause in last, last
        if last.startswith("the run stopped early"):
            assert f"{', '.join(failing)} {cause}" in last, last
    else:  # the others go on to the end
        assert server_code == 0 and worker_codes.count(0) == WORKERS - 1, (worker_codes, server_lines[-5:])
        summary = json.loads((tmp_path / "run" / "summary.json").read_text())
        assert summary["iterations"] == 12 and summary["workers_alive"] == WORKERS - 1


SERVER_FAULTS = [
    ("mdgan-update", [], "mdgan.gan:GeneratorSide.update", 5),
    ("flgan-average", ["--algorithm", "flgan"], "mdgan.algorithms.flgan:fedavg", 1),
    ("evaluation", ["--eval-every", "2", "--eval-data-root", "UNUSED"], "mdgan.run:PeriodicEvaluator._score", 0),
]


@pytest.mark.parametrize("case, flags, target, after", SERVER_FAULTS, ids=[c[0] for c in SERVER_FAULTS])
def test_a_server_error_is_told_to_every_worker_and_every_service_exits(tmp_path, monkeypatch, caplog, case, flags,
                                                                       target, after):
    if case == "evaluation":  # any scorer: the fault is in scoring itself
        from mdgan import run as run_module

        class Scorer:
            def evaluate(self, images):
                return {"score": 0.0}

        monkeypatch.setattr("services.server.__main__.make_evaluator", lambda side, root, every, samples, ref, *a:
                            run_module.PeriodicEvaluator(Scorer(), side, every, 4))
    message = _inject(monkeypatch, target, None, after)
    with caplog.at_level(logging.INFO):
        server_code, worker_codes, seconds = asyncio.run(_run_cluster(str(tmp_path / "run"), flags))
    assert server_code == 1 and worker_codes == [1] * WORKERS
    server_lines = [r.getMessage() for r in caplog.records if r.name == "mdgan.server"]
    assert server_lines[-1] == f"the server failed: RuntimeError: {message}", server_lines[-5:]
    told = [r.getMessage() for r in caplog.records if r.name == "mdgan.worker" and r.levelno == logging.ERROR]
    assert len([t for t in told if t == f"the server stopped the run: the server failed: RuntimeError: {message}"]) \
        == WORKERS, told


# -- real processes: mdgan local (mutual TLS) and the bare services ----------------------------
def _env(*faults: dict) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([FAULTS, REPO, os.environ.get("PYTHONPATH", "")]),
               MDGAN_TEST_FAULT=json.dumps(list(faults)))
    return env


def _local(tmp_path, *faults: dict, workers: int = 4, extra=()) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mdgan_app.cli", "local", "--workers", str(workers), "--workers-per-process", "1",
         "--dataset", "synthetic", "--iterations", "40", "--swap-every", "20", "--eval-every", "-1",
         "--out", str(tmp_path / "run"), "--overwrite", "--no-progress", *extra],  # (one folder for several runs)
        cwd=REPO, env=_env(*faults), capture_output=True, text=True, timeout=HANG_GUARD_S + 60)


def _no_service_left(out) -> None:
    mine = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
    assert not mine, f"processes of the run still alive: {mine}"


@pytest.mark.slow
def test_mdgan_local_names_the_failed_worker_and_goes_on_or_stops_with_its_line(tmp_path):
    one = _local(tmp_path, {"target": f"{W}.mdgan:MDGANWorker._on_batches", "worker": "worker-1", "after": 5})
    assert one.returncode == 0, one.stderr[-3000:]
    assert ("worker-1 exited with code 1 at iteration" in one.stderr and "the run goes on with the other workers"
            in one.stderr and "worker-1 failed while answering batches: RuntimeError: injected fault" in one.stderr)
    assert "mdgan (local): 40 iterations, 3 of 4 workers alive" in one.stdout
    _no_service_left(tmp_path)

    every = _local(tmp_path, {"target": f"{W}.mdgan.swaps:WorkerSwaps._swap"})  # every worker fails in the first swap
    assert every.returncode == 1, every.stderr[-3000:]
    last = every.stderr.strip().splitlines()[-2]  # (then "logs in ...")
    assert last == ("mdgan local: the run stopped early (20 of 40 iterations): no workers left after iteration 20: "
                    "worker-0, worker-1, worker-2, worker-3 failed while swapping (round 1): RuntimeError: injected "
                    f"fault in {W}.mdgan.swaps:WorkerSwaps._swap"), every.stderr[-3000:]
    _no_service_left(tmp_path)


@pytest.mark.slow
def test_mdgan_local_stops_every_process_when_the_server_fails(tmp_path):
    run = _local(tmp_path, {"target": "mdgan.gan:GeneratorSide.update", "after": 10})
    assert run.returncode == 1
    lines = run.stderr.strip().splitlines()
    assert lines[-2] == "mdgan local: the server failed: RuntimeError: injected fault in mdgan.gan:GeneratorSide.update"
    assert "exited with code" not in run.stderr  # the workers left because the server said so: no lines of theirs
    _no_service_left(tmp_path)
    for i in range(4):
        log = (tmp_path / "run" / "logs" / f"worker-{i}.log").read_text()
        assert log.rstrip().endswith("the server stopped the run: the server failed: RuntimeError: injected fault "
                                     "in mdgan.gan:GeneratorSide.update")


@pytest.mark.slow
@pytest.mark.parametrize("min_workers, server_code", [(None, 0), (2, 1)])
def test_bare_services_a_failed_worker_exits_1_and_the_server_goes_on_or_stops(tmp_path, min_workers, server_code):
    env = _env({"target": f"{W}.mdgan.swaps:WorkerSwaps._swap", "worker": "worker-1"})
    out = str(tmp_path)
    server, port = start_server(out, "--workers", "2", "--dataset", "synthetic", "--iterations", "30",
                                "--swap-every", "10", "--eval-every", "-1",
                                *(["--min-workers", str(min_workers)] if min_workers else []), env=env)
    workers = [start_worker(out, port, i, 2, "--dataset", "synthetic", env=env) for i in range(2)]
    try:
        assert server.wait(HANG_GUARD_S) == server_code, server.log()
        assert workers[1].wait(30) == 1 and workers[0].wait(30) == 0, (workers[0].log(), workers[1].log())
    finally:
        for proc in (server, *workers):
            proc.stop()
    log = server.log()
    assert "worker-1 failed while swapping (round 1): RuntimeError: injected fault" in log
    assert workers[1].log().rstrip().endswith("worker-1 failed while swapping (round 1): RuntimeError: injected "
                                              f"fault in {W}.mdgan.swaps:WorkerSwaps._swap")
    if server_code:
        assert log.rstrip().splitlines()[-1].endswith(
            "the run stopped early (10 of 30 iterations): only 1 workers after iteration 10, fewer than "
            "--min-workers 2: worker-1 failed while swapping (round 1): RuntimeError: injected fault in "
            f"{W}.mdgan.swaps:WorkerSwaps._swap")


@pytest.mark.slow
def test_bare_services_a_server_error_ends_every_process_with_its_line(tmp_path):
    env = _env({"target": "mdgan.gan:GeneratorSide.update", "after": 8})
    out = str(tmp_path)
    server, port = start_server(out, "--workers", "2", "--dataset", "synthetic", "--iterations", "30",
                                "--swap-every", "10", "--eval-every", "-1", env=env)
    workers = [start_worker(out, port, i, 2, "--dataset", "synthetic", env=env) for i in range(2)]
    try:
        assert server.wait(HANG_GUARD_S) == 1, server.log()
        assert [w.wait(30) for w in workers] == [1, 1]
    finally:
        for proc in (server, *workers):
            proc.stop()
    line = "the server failed: RuntimeError: injected fault in mdgan.gan:GeneratorSide.update"
    assert server.log().rstrip().endswith(line)
    for worker in workers:
        assert worker.log().rstrip().endswith(f"the server stopped the run: {line}")
