"""Durable, elastic runs with real processes: the server killed and resumed, workers killed and
restarted, chaos, a worker of another run. Every process is SIGKILLed like a crash would."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import time

import pytest

from procs import python_module, read_json, read_jsonl, start_server, start_worker, tls_flags, wait_for_iterations

from mdgan.config import DataConfig, ModelSpec, TrainingConfig
from mdgan.run import EvaluationOptions, RunFinished, finished_run_ids, open_run
from mdgan.simulation import simulate
from services.common import pki

pytestmark = pytest.mark.slow

N, KAPPA, ITERATIONS, SWAP_EVERY, CHECKPOINT_EVERY = 3, 2, 360, 100, 50
DISC_WIDTH = 64  # (a narrow discriminator: half the compute of the paper's 512, the same protocol)
TRAINING = ["--workers", str(N), "--kappa", str(KAPPA), "--iterations", str(ITERATIONS), "--swap-every",
            str(SWAP_EVERY), "--architecture", "mlp", "--disc-width", str(DISC_WIDTH), "--dataset", "synthetic",
            "--eval-every", "-1"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """A server on a fixed port (so a restarted one is found again) and N workers with state dirs."""

    def __init__(self, out: str, *server_flags: str):
        self.out = out
        # over mutual TLS, as by default: a restarted worker comes back with the same identity
        self.pki = os.path.join(out, "pki")
        pki.provision_run(self.pki, [f"worker-{i}" for i in range(N)])
        self.port = _free_port()
        self.server_flags = server_flags
        self.procs = []
        self.server = None
        self.workers: dict[int, object] = {}
        self.restarts = 0

    def start_server(self, *extra: str):
        self.restarts += 1
        self.server = python_module(f"server-{self.restarts}", [
            "services.server", "--listen", f"127.0.0.1:{self.port}", "--out", self.out, "--threads", "1",
            "--metrics-port", "0", "--checkpoint-every", str(CHECKPOINT_EVERY), "--step-timeout", "30",
            "--heartbeat-interval", "1", *TRAINING, *tls_flags(self.pki, "mdgan-server"), *self.server_flags, *extra],
            self.out)
        self.procs.append(self.server)
        return self.server

    def start_worker(self, index: int, *extra: str):
        self.restarts += 1
        worker = start_worker(self.out, self.port, index, N, "--dataset", "synthetic", "--state-dir",
                              os.path.join(self.out, "state", f"worker-{index}"), "--server-timeout", "90",
                              *tls_flags(self.pki, f"worker-{index}"), *extra)
        worker.name = f"worker-{index}-{self.restarts}"
        self.workers[index] = worker
        self.procs.append(worker)
        return worker

    def history(self) -> list[dict]:
        return read_jsonl(os.path.join(self.out, "history.jsonl"))

    def wait_for_iteration(self, iteration: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rows = self.history()
            if rows and rows[-1]["iteration"] >= iteration:
                return
            if self.server.popen.poll() is not None:
                raise AssertionError(f"the server exited early:\n{self.server.log()}")
            time.sleep(0.1)
        raise AssertionError(f"no iteration {iteration} within {timeout} s:\n{self.server.log()}")

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()


@pytest.fixture
def cluster_factory(tmp_path):
    made = []

    def make(name: str = "run", *flags: str) -> Cluster:
        c = Cluster(str(tmp_path / name), *flags)
        os.makedirs(c.out, exist_ok=True)
        made.append(c)
        return c

    yield make
    for c in made:  # on failure too
        c.stop()


_UNINTERRUPTED: list[str] = []  # (computed once a test process)


def _uninterrupted_sha(tmp_path) -> str:
    if not _UNINTERRUPTED:
        config = TrainingConfig(workers=N, kappa=KAPPA, iterations=ITERATIONS, swap_every=SWAP_EVERY,
                                model=ModelSpec(architecture="mlp", disc_width=DISC_WIDTH)).validate()
        summary = simulate(config, DataConfig("synthetic"), str(tmp_path / "reference"), progress=False,
                           evaluation=EvaluationOptions(every=-1))
        _UNINTERRUPTED.append(summary["generator_sha256"])
    return _UNINTERRUPTED[0]


def _assert_history_whole(rows: list[dict], total: int = ITERATIONS) -> None:
    iterations = [r["iteration"] for r in rows]
    assert iterations == list(range(1, total + 1)), "history has a gap or a duplicate line"


def test_a_server_stopped_with_sigterm_then_killed_resumes_each_time_and_ends_where_the_uninterrupted_run_ends(
        cluster_factory, tmp_path):
    """One run, two interruptions of its server. SIGTERM (the rolling update, `docker compose stop
    server`): it checkpoints where it stops and its workers stay up for the successor, with no traceback
    anywhere. SIGKILL (a crash): its successor resumes from the last periodic checkpoint and the workers
    find it by themselves. The run ends with the generator of the run that was never interrupted."""
    c = cluster_factory()
    c.start_server()
    for i in range(N):
        c.start_worker(i)
    c.wait_for_iteration(CHECKPOINT_EVERY + 20, 240)
    c.server.popen.send_signal(signal.SIGTERM)
    c.server.wait(60)
    log = c.server.log()
    stopped_at = c.history()[-1]["iteration"]
    assert f"stopped at iteration {stopped_at} by a signal" in log and f"checkpoint {stopped_at} complete" in log, log
    assert "Traceback" not in log and "CancelledError" not in log, log
    assert all(w.popen.poll() is None for w in c.workers.values())  # waiting for the successor
    c.start_server("--resume")
    assert f"resumed from iteration {stopped_at}" in c.server.wait_for_log("resumed from iteration", 120)

    # a periodic checkpoint after the successor's start, swaps before the kill and after it
    kill_at = random.Random().randint(stopped_at + CHECKPOINT_EVERY + 30, ITERATIONS - 100)
    c.wait_for_iteration(kill_at, 240)
    c.server.kill()
    killed_at = c.history()[-1]["iteration"]
    c.start_server("--resume")
    assert c.server.wait(300) == 0, c.server.log()
    for worker in c.workers.values():
        assert worker.wait(60) == 0, worker.log()
        assert f"restored our state of iteration {stopped_at}" in worker.log(), worker.log()
        assert "Traceback" not in worker.log(), worker.log()
    summary = read_json(os.path.join(c.out, "summary.json"))
    last = (killed_at // CHECKPOINT_EVERY) * CHECKPOINT_EVERY
    assert summary["resumed_from"] in (last, last - CHECKPOINT_EVERY), (summary["resumed_from"], killed_at)  # one may be in flight
    assert summary["workers_alive"] == N and summary["swaps"] == ITERATIONS // SWAP_EVERY
    _assert_history_whole(c.history())
    run = read_json(os.path.join(c.out, "run_identity.json"))
    assert summary["run_id"] == run["run_id"]
    assert summary["generator_sha256"] == _uninterrupted_sha(tmp_path)


def test_a_worker_killed_and_restarted_rejoins_the_run(cluster_factory):
    c = cluster_factory()
    c.start_server()
    for i in range(N):
        c.start_worker(i)
    c.wait_for_iteration(CHECKPOINT_EVERY + 30, 240)
    c.workers[1].kill()
    c.start_worker(1)
    assert c.server.wait(300) == 0, c.server.log()
    assert c.workers[1].wait(60) == 0, c.workers[1].log()
    summary = read_json(os.path.join(c.out, "summary.json"))
    assert summary["workers_alive"] == N and "worker-1" in summary["alive"]
    active = [r["active_workers"] for r in c.history()]
    dip = active.index(N - 1)
    assert active[:dip] == [N] * dip and active[-1] == N, "history shows no dip and recovery"
    assert "restored our state of iteration" in c.workers[1].log()
    _assert_history_whole(c.history())


def test_a_server_killed_after_telling_its_workers_the_run_is_over_resumes_only_to_write_its_outputs(
        cluster_factory):
    # Told the run is over, the workers forget it and leave. A server killed before writing its outputs
    # resumes from its final checkpoint, writes them, and waits for no one's return beyond a moment.
    total = CHECKPOINT_EVERY + 20  # the end is not a periodic checkpoint
    c = cluster_factory()
    c.start_server("--iterations", str(total))
    for i in range(N):
        c.start_worker(i)
    assert c.server.wait(240) == 0, c.server.log()
    for worker in c.workers.values():
        assert worker.wait(60) == 0, worker.log()
    first = read_json(os.path.join(c.out, "summary.json"))
    for name in ("summary.json", "samples.png", "checkpoint.pt"):  # what that kill leaves: no outputs yet
        os.remove(os.path.join(c.out, name))
    c.start_server("--resume", "auto", "--iterations", str(total), "--join-timeout", "300")
    assert c.server.wait(90) == 0, c.server.log()  # not the join timeout
    summary = read_json(os.path.join(c.out, "summary.json"))
    assert summary["resumed_from"] == total and summary["iterations"] == total
    assert summary["run_id"] == first["run_id"] and summary["generator_sha256"] == first["generator_sha256"]
    assert os.path.exists(os.path.join(c.out, "samples.png"))
    _assert_history_whole(c.history(), total)


def test_chaos_every_run_finishes(cluster_factory):
    """Random SIGKILLs of workers and of the server, each restarted after a moment: every run ends
    with a summary of all its iterations within BOUND seconds."""
    BOUND, TOTAL = 300, 300
    rng = random.Random()
    for run in range(1):  # (three random kills a run; each CI run draws others)
        c = cluster_factory(f"chaos-{run}")
        c.start_server("--iterations", str(TOTAL))
        for i in range(N):
            c.start_worker(i)
        started = time.monotonic()
        for kill in range(3):
            c.wait_for_iteration(rng.randint(30, 80) * (kill + 1), BOUND)
            victim = rng.choice(["server", 0, 1, 2])
            if victim == "server":
                c.server.kill()
                time.sleep(rng.uniform(0, 2))
                c.start_server("--resume", "auto", "--iterations", str(TOTAL))
            else:
                c.workers[victim].kill()
                time.sleep(rng.uniform(0, 2))
                c.start_worker(victim)
        remaining = BOUND - (time.monotonic() - started)
        assert c.server.wait(max(1, remaining)) == 0, c.server.log()
        summary = read_json(os.path.join(c.out, "summary.json"))
        assert summary["iterations"] == TOTAL, summary
        _assert_history_whole(c.history(), TOTAL)
        c.stop()


def test_a_worker_of_another_run_is_refused_with_a_clear_error(cluster_factory):
    c = cluster_factory()
    c.start_server("--run-id", "alpha")
    state = os.path.join(c.out, "state", "worker-0")
    os.makedirs(state)
    with open(os.path.join(state, "current.json"), "w") as fh:
        json.dump({"run_id": "beta", "shard_index": 0}, fh)
    worker = c.start_worker(0)
    code = worker.wait(120)
    log = worker.log()
    assert code != 0
    assert "FAILED_PRECONDITION" in log and "'beta'" in log and "'alpha'" in log, log


def test_a_worker_away_at_its_runs_end_forgets_that_run_and_joins_the_next(tmp_path):
    # A worker killed before its run ended keeps that run in its state. Restarted (a StatefulSet's
    # restart, compose's) into the next run, it learns from that run's server that its own run ended,
    # forgets it and joins; one pinned to the old run (--run-id) is done.
    pki_dir = str(tmp_path / "pki")
    pki.provision_run(pki_dir, ["worker-0", "worker-1", "worker-2"])
    flags = ["--workers", "2", "--iterations", "200", "--dataset", "synthetic", "--architecture", "mlp",
             "--disc-width", str(DISC_WIDTH), "--eval-every", "-1", "--checkpoint-every", "20",
             "--heartbeat-interval", "1"]
    state = [str(tmp_path / "state" / f"worker-{i}") for i in range(3)]

    def worker(out, port, i, *extra):
        return start_worker(out, port, i % 2, 2, "--dataset", "synthetic", "--state-dir", state[i],
                            "--server-timeout", "60", *tls_flags(pki_dir, f"worker-{i}"), *extra,
                            name=f"worker-{i}-{os.path.basename(out)}")

    first = str(tmp_path / "runs" / "first")
    server, port = start_server(first, *flags, "--run-id", "beta", *tls_flags(pki_dir, "mdgan-server"), name="server")
    away, stays = worker(first, port, 1), worker(first, port, 0)
    wait_for_iterations(server, first, 30)
    away.kill()
    assert server.wait(300) == 0 and stays.wait(60) == 0, server.log()
    assert read_json(os.path.join(state[1], "current.json")) == {"run_id": "beta", "shard_index": 1}

    # the next run starts in a directory beside the first, as the chart's server does
    second = str(tmp_path / "runs" / "second")
    server, port = start_server(second, *flags, "--run-id", "gamma", *tls_flags(pki_dir, "mdgan-server"),
                                name="server")
    pinned = worker(second, port, 2, "--run-id", "beta")  # joins run beta only: its end is this worker's
    back, stays = worker(second, port, 1), worker(second, port, 0)
    assert server.wait(300) == 0, server.log()
    for proc in (back, stays, pinned):
        assert proc.wait(60) == 0, proc.log()
    assert "run beta ended while we were away (the server says so): forgetting it" in back.log(), back.log()
    assert "Traceback" not in back.log()
    assert "run beta ended while we were away (the server says so): done" in pinned.log(), pinned.log()
    assert read_json(os.path.join(state[1], "current.json"))["run_id"] == "gamma"
    summary = read_json(os.path.join(second, "summary.json"))
    assert summary["run_id"] == "gamma" and summary["workers_alive"] == 2 and summary["iterations"] == 200


def test_the_runs_a_server_knows_to_have_ended(tmp_path):
    config = TrainingConfig(workers=2).validate()
    here, beside, unfinished = (str(tmp_path / name) for name in ("here", "beside", "unfinished"))
    for folder, run_id in ((here, "first"), (beside, "other"), (unfinished, "running")):
        open_run(folder, config, "auto", run_id)
    for folder in (here, beside):
        with open(os.path.join(folder, "summary.json"), "w") as fh:
            json.dump({}, fh)
    (tmp_path / "not-a-run").mkdir()
    assert finished_run_ids(here) == {"other"}  # its own run is the one it holds, not an ended one
    with pytest.raises(RunFinished, match="give --overwrite"):  # a finished run is replaced only when asked
        open_run(here, config, "auto")
    assert open_run(here, config, "auto", overwrite=True).run_id not in ("first", "other")  # a new run there
    assert finished_run_ids(here) == {"first", "other"}
    with open(os.path.join(here, "finished_runs.json"), "w") as fh:
        fh.write("{not json")
    assert finished_run_ids(here) == {"other"}  # a damaged list is no list, and no crash
