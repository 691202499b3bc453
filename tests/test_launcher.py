"""`mdgan local` supervises its processes: signals stop them all, a failing service stops the cluster."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import REPO
from procs import mdgan_in_process, session_processes

pytestmark = pytest.mark.slow


def descendants(pid: int) -> set[int]:
    """Every live process below pid (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def launch(tmp_path, *flags: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "mdgan_app.cli", "local", "--out", str(tmp_path / "run"),
                             "--no-progress", "--eval-every", "-1", *flags], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_until_training(launcher: subprocess.Popen, tmp_path, lines: int = 1) -> None:
    """Until RUN/history.jsonl has `lines` lines: the run is under way."""
    history = tmp_path / "run" / "history.jsonl"
    deadline = time.monotonic() + 120
    while not (history.exists() and history.read_text().count("\n") >= lines):
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
        time.sleep(0.1)


def service_pid(launcher: subprocess.Popen, tmp_path, name: str) -> int:
    """The process of `mdgan local` that writes RUN/logs/NAME.log (a service, or a process of workers)."""
    log = str(tmp_path / "run" / "logs" / f"{name}.log")
    found, = [p for p in descendants(launcher.pid) if os.path.realpath(f"/proc/{p}/fd/1") == log]
    return found


def kill_everything(launcher: subprocess.Popen, pids: set[int]) -> None:
    for pid in [launcher.pid, *pids, *descendants(launcher.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    launcher.communicate()


def parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as fh:
        return int(fh.read().rsplit(")", 1)[1].split()[1])


def thread_affinities(pid: int) -> set[tuple[int, ...]]:
    """The CPU sets of every thread of process pid (gRPC's and torch's included), each sorted."""
    found = set()
    for thread in os.listdir(f"/proc/{pid}/task"):
        try:
            found.add(tuple(sorted(os.sched_getaffinity(int(thread)))))
        except ProcessLookupError:  # ended meanwhile
            pass
    return found


# (one cluster start-up per case checks both: what a signal leaves behind, and how the services
# are scheduled and placed)
@pytest.mark.parametrize("sig, scheduling, workers, per_process, pin, threads", [
    (signal.SIGTERM, "batch", 2, 1, "auto", 1), (signal.SIGHUP, "normal", 2, 1, "off", 1),
    (signal.SIGINT, "batch", 4, 2, "auto", 1),  # two processes of two workers each
    (signal.SIGTERM, "batch", 2, 1, "auto", 2)])  # two threads each: two CPUs a process, or none pinned
def test_a_signal_to_mdgan_local_leaves_no_process_behind_and_its_services_run_as_scheduled(
        tmp_path, capsys, sig, scheduling, workers, per_process, pin, threads):
    launcher = launch(tmp_path, "--dataset", "synthetic", "--workers", str(workers), "--iterations", "1000000",
                      "--cpu-scheduling", scheduling, "--workers-per-process", str(per_process),
                      "--pin-workers", pin, "--threads", str(threads))
    pids: set[int] = set()
    try:
        wait_until_training(launcher, tmp_path)
        pids = descendants(launcher.pid)
        assert len(pids) >= 3  # the server and two worker processes (and the fork server they came from)
        services = [p for p in pids if parent(p) != launcher.pid]  # the fork server's children
        assert len(services) == 3
        expected = os.SCHED_BATCH if scheduling == "batch" else os.SCHED_OTHER
        assert [os.sched_getscheduler(p) for p in services] == [expected] * 3
        # Placed: with two CPUs or more, and `threads` of them for each, each of the two worker
        # processes (every one of its threads) on CPUs of its own and the server free; unpinned,
        # all three free.
        cpus = sorted(os.sched_getaffinity(0))
        placed = sorted(sorted(thread_affinities(p)) for p in services)
        free = [tuple(cpus)]
        pinned = pin == "auto" and len(cpus) >= 2 and 2 * threads <= len(cpus)
        if pinned:
            assert placed == sorted([[tuple(cpus[:threads])], [tuple(cpus[threads:2 * threads])], free])
        else:
            assert placed == [free] * 3
        # the service's own --cpu-scheduling, forwarded: said in each worker process's log
        process_logs = [f"worker-{i}" for i in range(workers)] if per_process == 1 else \
            [f"workers-{i}-{i + per_process - 1}" for i in range(0, workers, per_process)]
        for name in process_logs:
            text = (tmp_path / "run" / "logs" / f"{name}.log").read_text()
            assert ("CPU scheduling: SCHED_BATCH" in text) == (scheduling == "batch"), name
            assert ("CPU affinity: pinned to CPU" in text) == pinned, name
        # A second run in the same folder is refused while this one is under way (it would remove this
        # run's logs and overwrite its history).
        from mdgan_app import cli

        assert cli.main(["local", "--dataset", "synthetic", "--workers", "2", "--out", str(tmp_path / "run")]) == 2
        assert f"a run is under way there (mdgan local, pid {launcher.pid})" in capsys.readouterr().err
        assert (tmp_path / "run" / "logs" / "server.log").exists()
        launcher.send_signal(sig)
        _, err = launcher.communicate(timeout=60)
        assert launcher.returncode == 128 + sig
        assert signal.Signals(sig).name in err
        # Gone when `mdgan local` has exited, not a moment later: the fork server too.
        assert not [p for p in pids if alive(p)]
        for index in range(workers):  # every worker stopped as told, and said so in its own log
            assert "terminated by signal" in (tmp_path / "run" / "logs" / f"worker-{index}.log").read_text()
    finally:
        kill_everything(launcher, pids)


@pytest.mark.parametrize("per_process", ["1", "2"])
def test_a_worker_that_cannot_load_its_data_stops_the_cluster_with_its_error(tmp_path, per_process):
    raw = tmp_path / "data" / "MNIST" / "raw"
    raw.mkdir(parents=True)
    # A truncated image file: the right magic number and dimensions, then only a few images.
    header = (0x00000803).to_bytes(4, "big") + (60000).to_bytes(4, "big") + (28).to_bytes(4, "big") * 2
    (raw / "train-images-idx3-ubyte").write_bytes(header + bytes(984))
    (raw / "train-labels-idx1-ubyte").write_bytes((0x00000801).to_bytes(4, "big") + (60000).to_bytes(4, "big")
                                                 + bytes(60000))
    started = time.monotonic()
    launcher = launch(tmp_path, "--dataset", "mnist", "--data-root", str(tmp_path / "data"), "--workers", "2",
                      "--iterations", "10", "--workers-per-process", per_process)
    try:
        _, err = launcher.communicate(timeout=120)
        assert launcher.returncode != 0
        assert "worker-" in err and "before the run started" in err
        if per_process == "2":  # the worker is named, and its process
            assert "(in process workers-0-1)" in err
        assert "train-images-idx3-ubyte: truncated" in err  # the worker's own error, from its log
        assert "Traceback" not in err  # one line, not a traceback
        assert time.monotonic() - started < 120  # not the server's 600 s join timeout
    finally:
        kill_everything(launcher, set())


def test_an_earlier_runs_logs_and_exit_codes_in_the_same_folder_do_not_fail_a_new_run(tmp_path):
    # What a failed run leaves: its worker process's exit codes and its workers' logs. Read as the
    # new run's, they stopped it within seconds with the old error.
    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    (logs / "workers-0-1.status.json").write_text('{"worker-0": 3, "worker-1": 3}')
    (logs / "worker-0.log").write_text("ERROR the server refused us: an earlier run's reason\n")
    (logs / "worker-7.log").write_text("a worker of an earlier, larger run\n")
    launcher = launch(tmp_path, "--dataset", "synthetic", "--workers", "2", "--workers-per-process", "2",
                      "--iterations", "5")
    try:
        _, err = launcher.communicate(timeout=180)
    finally:
        kill_everything(launcher, set())
    assert launcher.returncode == 0, err
    assert "earlier run" not in err
    assert sorted(os.listdir(logs)) == ["server.log", "worker-0.log", "worker-1.log", "workers-0-1.log",
                                        "workers-0-1.status.json"]
    assert json.loads((logs / "workers-0-1.status.json").read_text()) == {"worker-0": 0, "worker-1": 0}


def test_before_the_start_only_a_failed_service_fails_the_cluster(tmp_path):
    """A run of a few iterations can end (workers exit 0) between two looks of the launcher: that
    is not a service failing before the start; an exit with another code is. A worker in a process of
    several is judged by its own exit code, from the process's status file."""
    from types import SimpleNamespace

    from mdgan_app.launcher import LocalCluster, ServiceFailed
    from mdgan.checkpoint import atomic_write_json

    def cluster(*codes, groups=None):
        made = LocalCluster(SimpleNamespace(out=str(tmp_path)))
        made.processes = [(f"worker-{i}", SimpleNamespace(exitcode=c)) for i, c in enumerate(codes)]
        for name, members in (groups or {}).items():
            made.processes.append((name, SimpleNamespace(exitcode=None)))
            made.groups[name] = list(members)
            atomic_write_json(made.status_path(name), members)
        return made

    os.makedirs(tmp_path / "logs")
    cluster(None, 0, 0).check_children(started=False)  # no raise
    with pytest.raises(ServiceFailed, match="worker-1 exited with code 2"):
        cluster(0, 2).check_children(started=False)
    with pytest.raises(ServiceFailed, match="worker-0 was killed by SIGKILL"):
        cluster(-9).check_children(started=False)
    (tmp_path / "logs" / "worker-3.log").write_text("ERROR worker-3's own reason\n")
    cluster(groups={"workers-2-3": {"worker-2": None, "worker-3": 0}}).check_children(started=False)
    with pytest.raises(ServiceFailed, match=r"(?s)worker-3 \(in process workers-2-3\) exited with code 2.*own reason"):
        cluster(groups={"workers-2-3": {"worker-2": None, "worker-3": 2}}).check_children(started=False)
    cluster(groups={"workers-2-3": {"worker-2": None, "worker-3": 2}}).check_children(started=True)  # the run's business


def test_a_worker_that_ends_after_the_start_is_told_once_and_the_run_goes_on(tmp_path):
    """After the start a lost worker does not stop the run, but the operator is told: which worker,
    how it ended, when, and its log (an error's last line with it); each only once."""
    from types import SimpleNamespace

    from mdgan_app.launcher import LocalCluster
    from mdgan.checkpoint import atomic_write_json

    made = LocalCluster(SimpleNamespace(out=str(tmp_path)))
    os.makedirs(tmp_path / "logs")
    (tmp_path / "logs" / "worker-1.log").write_text("INFO joined\nERROR worker-1's own reason\n")
    (tmp_path / "logs" / "worker-3.log").write_text("ERROR worker-3's own reason\n")
    single = {"server": SimpleNamespace(exitcode=None), "worker-0": SimpleNamespace(exitcode=None),
              "worker-1": SimpleNamespace(exitcode=None)}
    group = SimpleNamespace(exitcode=None)
    made.processes = [*single.items(), ("workers-2-4", group)]
    made.groups["workers-2-4"] = ["worker-2", "worker-3", "worker-4"]
    atomic_write_json(made.status_path("workers-2-4"), {"worker-2": None, "worker-3": None, "worker-4": None})
    assert made.departures(5) == []  # all running
    single["worker-0"].exitcode = 0  # a worker stopped by the server at the end: nothing to tell
    single["worker-1"].exitcode = 2
    atomic_write_json(made.status_path("workers-2-4"), {"worker-2": None, "worker-3": 1, "worker-4": None})
    lines = made.departures(12)
    assert len(lines) == 2
    assert lines[0].startswith("worker-1 exited with code 2 at iteration 12; the run goes on")
    assert lines[0].endswith("worker-1.log): ERROR worker-1's own reason")
    assert lines[1].startswith("worker-3 (in process workers-2-4) exited with code 1 at iteration 12")
    assert lines[1].endswith("worker-3's own reason")
    assert made.departures(13) == []  # told once
    group.exitcode = -9  # its process killed: the workers still in it end with it, told in one line
    lines = made.departures(20)
    assert lines == [f"process workers-2-4 (worker-2, worker-4) was killed by SIGKILL at iteration 20; the run "
                     f"goes on with the other workers (log: {tmp_path / 'logs' / 'workers-2-4.log'})"]
    single["server"].exitcode = 1  # the server's own end is not a departure (follow() reports it)
    assert made.departures(21) == []


def test_a_worker_killed_mid_run_is_told_and_the_run_ends_with_the_others(tmp_path):
    launcher = launch(tmp_path, "--dataset", "synthetic", "--workers", "2", "--workers-per-process", "1",
                      "--iterations", "600", "--swap-every", "1000000")
    try:
        log = str(tmp_path / "run" / "logs" / "worker-1.log")
        wait_until_training(launcher, tmp_path, 5)
        os.kill(service_pid(launcher, tmp_path, "worker-1"), signal.SIGKILL)
        _, err = launcher.communicate(timeout=300)
    finally:
        kill_everything(launcher, set())
    assert launcher.returncode == 0, err  # the run went on and finished
    told = [line for line in err.splitlines() if "worker-1 was killed by SIGKILL at iteration" in line]
    assert len(told) == 1, err
    assert f"the run goes on with the other workers (log: {log})" in told[0]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["iterations"] == 600 and summary["workers_alive"] == 1
    assert summary["exit_codes"]["worker-1"] == -signal.SIGKILL and summary["exit_codes"]["worker-0"] == 0


def test_a_worker_paused_past_its_deadline_rejoins_when_it_wakes(tmp_path):
    """A worker frozen (SIGSTOP: a paused VM, a swap storm) is dropped at the step deadline, at the swap
    deadline when the pause caught it in a swap (the copy a rejoining worker takes, too), or, frozen
    between steps, once it has been silent for the liveness timeout. When it wakes it finishes what it
    held, finds the stream ended, and rejoins: no traceback, and it never exits."""
    launcher = launch(tmp_path, "--dataset", "synthetic", "--workers", "2", "--workers-per-process", "1",
                      "--iterations", "1000000", "--step-timeout", "2", "--swap-timeout", "10")
    logs = tmp_path / "run" / "logs"
    try:
        wait_until_training(launcher, tmp_path)
        victim = service_pid(launcher, tmp_path, "worker-1")
        for pause in (1, 2):  # (twice: it failed only when the pause caught the worker holding a batch)
            os.kill(victim, signal.SIGSTOP)
            deadline = time.monotonic() + 60
            # dropped at a step's or a swap's deadline, or found silent when the pause caught it between steps
            while sum((logs / "server.log").read_text().count(drop)
                      for drop in ("dropping worker-1", "worker-1 lost: silent")) < pause:
                assert time.monotonic() < deadline, (logs / "server.log").read_text()
                time.sleep(0.2)
            time.sleep(1)  # the stream's end waits for it
            os.kill(victim, signal.SIGCONT)
            deadline = time.monotonic() + 60
            while (logs / "server.log").read_text().count("worker-1 joined") < 1 + pause:  # back in the run
                assert alive(victim) and time.monotonic() < deadline, (logs / "worker-1.log").read_text()
                time.sleep(0.2)
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=60)
    finally:
        kill_everything(launcher, set())
    worker_log = (logs / "worker-1.log").read_text()
    assert "Traceback" not in worker_log and "lost the server" in worker_log, worker_log
    assert "worker-1 exited" not in err, err  # it never left: told nothing
    assert launcher.returncode == 128 + signal.SIGTERM


def upset_the_server(tmp_path, server_signal: int, launcher_signal: int | None = None,
                     flags: tuple = ()) -> tuple[int, str, float, list]:
    """Send the server of a running `mdgan local` server_signal, then the launcher launcher_signal (if any);
    (the launcher's exit status, its stderr, seconds from the server's signal to the launcher's end, the
    processes of the cluster still alive 10 s after it)."""
    launcher = launch(tmp_path, "--dataset", "synthetic", "--workers", "2", "--iterations", "1000000", *flags)
    pids: set[int] = set()
    try:
        wait_until_training(launcher, tmp_path)
        pids = descendants(launcher.pid)
        os.kill(service_pid(launcher, tmp_path, "server"), server_signal)
        upset = time.monotonic()
        if launcher_signal is not None:
            launcher.send_signal(launcher_signal)
        _, err = launcher.communicate(timeout=120)
        took = time.monotonic() - upset
        deadline = time.monotonic() + 10
        while [p for p in pids if alive(p)] and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [p for p in pids if alive(p)]
    finally:
        kill_everything(launcher, pids)
    return launcher.returncode, err, took, left


def test_a_server_killed_mid_run_stops_the_cluster_at_once_with_one_clear_line(tmp_path):
    # The launcher waited the 30 s grace for workers that were only trying to reconnect, said "the
    # server exited with -9", exited with status 247 (-9 given to sys.exit), and the resource tracker
    # warned of a semaphore leaked by the server (tqdm's lock).
    code, err, took, left = upset_the_server(tmp_path, signal.SIGKILL)
    assert code == 1, err
    assert err.startswith("mdgan local: the server was killed by SIGKILL; the end of its log:"), err
    assert "leaked" not in err and "Traceback" not in err, err
    assert took < 20, took  # not the 30 s grace given to workers of a server that ended well
    assert not left


def test_a_signal_to_mdgan_local_whose_server_is_frozen_says_why_it_waits_and_leaves_nothing(tmp_path):
    # The server is stopped first and given its stop grace: frozen (SIGSTOP), it cannot use it, and the
    # stop must still end, saying what it waits for, with every process gone.
    code, err, _, left = upset_the_server(tmp_path, signal.SIGSTOP, signal.SIGTERM, ("--stop-grace", "4"))
    assert code == 128 + signal.SIGTERM, err
    assert "waiting up to 6 s more for the server to checkpoint where it stopped" in err, err
    assert "Traceback" not in err and "leaked" not in err, err
    assert not left


def test_mdgan_local_killed_outright_leaves_no_process_behind(tmp_path):
    # Every service holds a copy of the fork server's "alive" pipe (multiprocessing gives its children
    # one), so the fork server did not see the launcher die, and the services, which die with the
    # fork server, trained on, orphaned, to the end of the run.
    launcher = launch(tmp_path, "--dataset", "synthetic", "--workers", "4", "--iterations", "1000000")
    pids: set[int] = set()
    try:
        wait_until_training(launcher, tmp_path)
        pids = descendants(launcher.pid)
        assert len(pids) >= 4  # the fork server, the server and two worker processes
        launcher.kill()
        launcher.wait()  # (not communicate(): the fork server shares its output pipes, open while it lives)
        deadline = time.monotonic() + 60
        while session_processes(launcher.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = session_processes(launcher.pid)
    finally:
        for pid in session_processes(launcher.pid):
            os.kill(pid, signal.SIGKILL)
        kill_everything(launcher, pids)
    assert left == []
    # stopped as by a signal (SIGTERM from the kernel as its parent died), so the run can resume
    assert "resume with --resume" in (tmp_path / "run" / "logs" / "server.log").read_text()


def test_a_resumed_mdgan_local_goes_on_with_the_settings_it_was_launched_with(tmp_path):
    # --resume RUN took the run's workers and iterations only: a run on synthetic data (or another data
    # root, split, ...) resumed with the defaults' data (here: no MNIST, a failure), and a run without
    # --checkpoint-every on the resume command would never have checkpointed again.
    flags = ["--dataset", "synthetic", "--workers", "2", "--iterations", "160", "--swap-every", "40",
             "--split", "dirichlet", "--dirichlet-alpha", "0.3", "--seed", "7"]
    launcher = launch(tmp_path, *flags, "--checkpoint-every", "20")
    try:
        wait_until_training(launcher, tmp_path, 50)
        launcher.send_signal(signal.SIGTERM)  # the server checkpoints at the next boundary
        _, err = launcher.communicate(timeout=120)
    finally:
        kill_everything(launcher, set())
    assert launcher.returncode == 128 + signal.SIGTERM, err
    run = tmp_path / "run"
    stopped_at = len((run / "history.jsonl").read_text().splitlines())
    resumed = subprocess.run([sys.executable, "-m", "mdgan_app.cli", "local", "--resume", str(run), "--no-progress"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=300)  # from another folder
    assert resumed.returncode == 0, resumed.stderr
    summary = json.loads((run / "summary.json").read_text())
    # From the stop's own checkpoint: the server is stopped before its workers, who write their states to it.
    assert summary["iterations"] == 160 and summary["resumed_from"] == stopped_at
    import tomllib

    launched = tomllib.loads((run / "launch.toml").read_text())  # a --config file: a key per flag
    assert launched["dataset"] == "synthetic" and launched["checkpoint-every"] == 20 and launched["split"] == "dirichlet"
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir())[-1] == 160  # checkpointing went on
    [earlier] = (run / "earlier-logs").iterdir()  # the logs of the start before, which say why it stopped
    assert f"stopped at iteration {stopped_at} by a signal" in (earlier / "server.log").read_text()
    assert "restores its state of iteration" in (run / "logs" / "server.log").read_text()
    mdgan_in_process("simulate", "--out", str(tmp_path / "reference"), "--no-progress", "--eval-every", "-1", *flags)
    uninterrupted = json.loads((tmp_path / "reference" / "summary.json").read_text())
    assert summary["generator_sha256"] == uninterrupted["generator_sha256"]


def test_a_launch_file_or_a_flag_that_cannot_be_taken_on_resume_is_one_clear_error(tmp_path, capsys, monkeypatch):
    from mdgan.config import TrainingConfig
    from mdgan.run import open_run
    from mdgan_app.cli import main

    run = tmp_path / "run"
    open_run(str(run), TrainingConfig(workers=2).validate())
    cases = [("launch.toml", 'threads = "two"', "launch.toml: threads is 'two', not a number"),
             ("launch.toml", "dataset = 5", "launch.toml: dataset is 5, not a str"),
             ("launch.toml", 'insecure = "no"', "launch.toml: insecure is 'no', not a bool"),
             ("launch.toml", "threads = ", "launch.toml is unreadable"),
             ("launch.toml", "", ""),
             # what an older mdgan wrote is still read
             ("launch.json", '["not", "settings"]', "launch.json holds no settings"),
             ("launch.json", '{"threads": "two"}', "launch.json: threads is 'two', not a number"),
             ("launch.json", '{"threads": ', "launch.json is unreadable"),
             ("launch.json", '{}', "")]
    for name, text, says in cases:
        for old in ("launch.toml", "launch.json"):
            (run / old).unlink(missing_ok=True)
        (run / name).write_text(text)
        monkeypatch.chdir(tmp_path)
        capsys.readouterr()
        code = main(["local", "--resume", str(run), "--no-progress", *([] if says else ["--workers", "3"])])
        stderr = capsys.readouterr().err
        says = says or "the run has workers 2; --workers 3 cannot change it"  # a run's size is its own
        assert code == 2 and says in stderr, (name, text, stderr)
        assert "Traceback" not in stderr and not (run / "logs").exists(), stderr  # nothing started


def test_a_resumed_runs_earlier_logs_are_kept_aside_the_newest_five(tmp_path):
    from mdgan_app import launcher as cluster

    logs, earlier = tmp_path / "logs", tmp_path / "earlier-logs"
    cluster.keep_earlier_logs(str(logs), str(earlier))  # none yet: nothing to keep
    assert not earlier.exists()
    for start in range(7):
        logs.mkdir()
        (logs / "server.log").write_text(f"start {start}\n")
        cluster.keep_earlier_logs(str(logs), str(earlier), now=time.struct_time((2026, 1, 1, 0, 0, start, 0, 1, 0)))
        assert not logs.exists()
    kept = sorted(earlier.iterdir())
    assert [p.name for p in kept] == [f"20260101T00000{s}Z" for s in range(2, 7)]
    assert [(p / "server.log").read_text() for p in kept] == [f"start {s}\n" for s in range(2, 7)]


def test_the_options_a_command_gives_are_told_apart_from_its_defaults(monkeypatch):
    from services.common.settings import EnvArgumentParser, given_options

    parser = EnvArgumentParser(prog="p")
    parser.add_argument("--data-root", default="data")
    parser.add_argument("--dataset", default="mnist")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-progress", action="store_true")
    monkeypatch.delenv("MDGAN_THREADS", raising=False)
    assert given_options(parser, []) == set()
    assert given_options(parser, ["--data-root", "/x", "--no-progress"]) == {"data_root", "no_progress"}
    assert given_options(parser, ["--dataset=synthetic"]) == {"dataset"}
    assert given_options(parser, ["--data-", "/x"]) == set()  # our parsers take no abbreviation: refused below
    with pytest.raises(SystemExit):
        parser.parse_args(["--data-", "/x"])
    plain = argparse.ArgumentParser(prog="p")  # (a parser that takes them: the one it names)
    plain.add_argument("--data-root", default="data")
    plain.add_argument("--dataset", default="mnist")
    assert given_options(plain, ["--data-", "/x"]) == {"data_root"}
    assert given_options(plain, ["--data", "/x"]) == set()  # ambiguous: argparse refuses it anyway
    assert given_options(parser, ["--", "--threads"]) == set()
    monkeypatch.setenv("MDGAN_THREADS", "2")
    assert given_options(parser, []) == {"threads"}


def test_workers_per_process_makes_one_worker_process_per_core(monkeypatch):
    from mdgan.config import ConfigError
    from mdgan_app import launcher as cluster

    monkeypatch.setattr(cluster, "usable_cores", lambda: 2)
    assert [cluster.workers_per_process(n, 0) for n in (1, 2, 3, 4, 10, 50)] == [1, 1, 2, 2, 5, 25]
    monkeypatch.setattr(cluster, "usable_cores", lambda: 16)
    assert [cluster.workers_per_process(n, 0) for n in (4, 10, 50)] == [1, 1, 4]
    assert cluster.workers_per_process(10, 3) == 3  # as asked
    with pytest.raises(ConfigError, match="workers-per-process"):
        cluster.workers_per_process(10, -1)


def test_more_workers_than_one_machine_has_ports_for_is_a_clear_error(monkeypatch, capsys, tmp_path):
    # It used to look for 70001 free ports forever, printing nothing.
    from mdgan_app import cli, launcher as cluster

    code = cli.main(["local", "--workers", "40000", "--kappa", "1", "--dataset", "synthetic",
                     "--out", str(tmp_path / "run")])
    assert code == 2
    assert "--workers 40000: a cluster on one machine needs 80002 ports" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # said before anything was made
    # Only the kernel's choice left, and the kernel short of ports (it hands out the same one again):
    # an error, not a search without end.
    class ShortOfPorts:
        def __init__(self, *_):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *_):
            pass

        def bind(self, address):
            pass

        def getsockname(self):
            return ("127.0.0.1", 40000)

    monkeypatch.setattr(cluster, "_ephemeral_range", lambda: (1, 65535))
    monkeypatch.setattr(cluster.socket, "socket", ShortOfPorts)
    with pytest.raises(cli.ConfigError, match=r"only 1 of the 3 ports the services need are free on 127.0.0.1"):
        cluster._free_ports(3)


def test_metrics_ports_are_free_distinct_and_outside_the_kernels_ephemeral_range():
    # The kernel gives ephemeral ports to every outgoing connection and `--listen HOST:0` of the
    # cluster's own services; a metrics port picked from that range was taken by one of them in a
    # 50-worker run ("Address already in use" at a worker's /metrics).
    from mdgan_app import launcher as cluster

    low, high = cluster._ephemeral_range()
    ports = cluster._free_ports(60)
    assert len(set(ports)) == 60
    assert not [p for p in ports if low <= p <= high]
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free now


def test_a_taken_port_is_skipped(monkeypatch):
    from mdgan_app import launcher as cluster

    def free(port: int) -> bool:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return True
            except OSError:
                return False

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    while not free(taken.getsockname()[1] + 1):  # the port above it must be free for this test
        taken.close()
        taken = socket.socket()
        taken.bind(("127.0.0.1", 0))
    with taken:
        taken.listen()
        port = taken.getsockname()[1]
        # Only `port` and `port + 1` lie outside the (pretended) ephemeral range.
        monkeypatch.setattr(cluster, "_ephemeral_range", lambda: (port + 2, 65535))
        ports = cluster._free_ports(2, floor=port)
    assert port not in ports and port + 1 in ports and len(set(ports)) == 2


# `mdgan local` with a SIGTERM to itself right after the fork server forked its K-th service (MDGAN_TEST_SIGTERM_AT),
# before that service has been sent what to run
SIGTERM_AT_START = """
import multiprocessing.forkserver, os, signal, sys
connect, started = multiprocessing.forkserver.connect_to_new_process, []
def connect_then_sigterm(fds):
    answer = connect(fds)
    started.append(1)
    if len(started) == int(os.environ["MDGAN_TEST_SIGTERM_AT"]):
        signal.raise_signal(signal.SIGTERM)  # (its handler runs here and now)
    return answer
multiprocessing.forkserver.connect_to_new_process = connect_then_sigterm
from mdgan_app.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("at", [1, 2], ids=["the server", "a worker"])
def test_a_sigterm_while_a_service_starts_stops_the_cluster_once_it_has(tmp_path, at):
    """A SIGTERM that comes between a service's fork and the sending of what it is to run (here: exactly there) is
    handled once the service has started: the cluster stops as on any SIGTERM, with no traceback (a service sent
    half its start printed EOFError) and no process left."""
    command = subprocess.Popen([sys.executable, "-c", SIGTERM_AT_START, "local", "--workers", "3", "--iterations",
                                "50", "--dataset", "synthetic", "--no-progress", "--out", str(tmp_path / "run")],
                               cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True, env=dict(os.environ, MDGAN_TEST_SIGTERM_AT=str(at)))
    try:
        out, _ = command.communicate(timeout=120)
        assert command.returncode == 128 + signal.SIGTERM and "Traceback" not in out, out
        assert out.strip().splitlines()[-1] == "mdgan local: SIGTERM: stopping the cluster", out
        deadline = time.monotonic() + 30
        while session_processes(command.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert session_processes(command.pid) == []
    finally:
        for pid in session_processes(command.pid):
            os.kill(pid, signal.SIGKILL)


def test_stopping_the_cluster_ends_multiprocessings_helper_processes():
    # Left alone, the fork server and the resource tracker end only once the launcher's process has
    # exited (their pipes close then): for a moment they outlived `mdgan local`.
    import multiprocessing
    from multiprocessing import forkserver, resource_tracker

    from mdgan_app import launcher as cluster

    child = multiprocessing.get_context("forkserver").Process(target=int)
    child.start()
    child.join(30)
    helpers = [forkserver._forkserver._forkserver_pid, resource_tracker._resource_tracker._pid]
    assert all(pid is not None and alive(pid) for pid in helpers)
    cluster._stop_multiprocessing_helpers()
    assert not [pid for pid in helpers if alive(pid)]
    assert forkserver._forkserver._forkserver_pid is None and resource_tracker._resource_tracker._pid is None


def test_batch_scheduling_sets_the_policy_and_the_slice():
    code = ("import os; from services.common import scheduling; print(scheduling.batch()); "
            "print(os.sched_getscheduler(0) == os.SCHED_BATCH); print(open('/proc/self/sched').read())")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    applied, is_batch, sched = out.split("\n", 2)
    assert is_batch == "True"
    fields = dict(line.split(":", 1) for line in sched.splitlines() if ":" in line)
    if "se.slice" in {k.strip() for k in fields}:  # Linux 6.12+: the slice is ours
        assert applied == "SCHED_BATCH, 10 ms slice"
        assert int(next(v for k, v in fields.items() if k.strip() == "se.slice")) == 10_000_000


def test_batch_scheduling_falls_back_and_never_raises():
    # No sched_setattr (another architecture, or a seccomp filter): the policy alone. Nothing
    # allowed at all: unchanged, said, not raised.
    code = """
import os
from services.common import scheduling
scheduling._SCHED_SETATTR.clear()
print(scheduling.batch(), os.sched_getscheduler(0) == os.SCHED_BATCH)
def refuse(*args):
    raise PermissionError(1, "Operation not permitted")
os.sched_setscheduler = refuse
print(scheduling.batch())
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["SCHED_BATCH True", "unchanged: [Errno 1] Operation not permitted"]


def test_worker_processes_get_a_cpu_each_only_when_there_are_enough():
    from services.common import scheduling

    assert scheduling.worker_cpus(2, "auto", 1, {0, 1}) == [{0}, {1}]
    assert scheduling.worker_cpus(2, "auto", 1, {7, 2, 5}) == [{2}, {5}]  # the launcher's own CPUs, in order
    assert scheduling.worker_cpus(1, "auto", 1, {0, 1}) == [{0}]
    assert scheduling.worker_cpus(3, "auto", 1, {0, 1}) == [None] * 3  # more processes than CPUs: the kernel's
    assert scheduling.worker_cpus(1, "auto", 1, {3}) == [None]  # one CPU: nothing to choose
    assert scheduling.worker_cpus(2, "off", 1, {0, 1}) == [None, None]
    # --threads T: T CPUs a process, when there are enough; torch's default (0) wants every core
    assert scheduling.worker_cpus(2, "auto", 2, {0, 1, 2, 3, 4}) == [{0, 1}, {2, 3}]
    assert scheduling.worker_cpus(2, "auto", 2, {0, 1}) == [None, None]
    assert scheduling.worker_cpus(1, "auto", 2, {0, 1}) == [{0, 1}]
    assert scheduling.worker_cpus(2, "auto", 0, {0, 1, 2, 3}) == [None, None]
    with pytest.raises(scheduling.ConfigError, match="auto or off"):
        scheduling.worker_cpus(2, "on", 1, {0, 1})
    assert scheduling.cpu_list({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"


def test_cpu_lists_and_threads_that_fit_them():
    from services.common import scheduling

    assert scheduling.parse_cpu_list("3") == {3}
    assert scheduling.parse_cpu_list("0-2,5, 7-8") == {0, 1, 2, 5, 7, 8}
    for bad in ("", "-1", "x", "1-", "0,,1", "2-1", "1.5"):
        with pytest.raises(ValueError):
            scheduling.parse_cpu_list(bad)
    assert scheduling.check_threads_fit(0, None) == 0  # not pinned: torch's default stays torch's
    assert scheduling.check_threads_fit(3, None) == 3
    assert scheduling.check_threads_fit(0, {4, 5}) == 2  # pinned: one per CPU it is kept on
    assert scheduling.check_threads_fit(1, {4, 5}) == 1
    with pytest.raises(scheduling.ConfigError, match=r"--threads 2 with --pin-cpu 4: more torch threads than CPUs"):
        scheduling.check_threads_fit(2, {4})


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning to the only CPU changes nothing")
def test_pinning_keeps_every_thread_on_the_cpu_those_started_before_and_after():
    code = """
import os, threading
from services.common import scheduling
everything = sorted(os.sched_getaffinity(0))
cpu = everything[-1]
stop = threading.Event()
before = threading.Thread(target=stop.wait); before.start()
print(scheduling.pin({cpu}))
after = threading.Thread(target=stop.wait); after.start()
print(cpu, sorted({tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir("/proc/self/task")}))
stop.set()
before.join(); after.join()
os.sched_setaffinity(0, everything)  # free again, then kept on two CPUs
print(scheduling.pin(everything[:2]), sorted(os.sched_getaffinity(0)) == everything[:2])
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    applied, placed, widened = out.splitlines()
    cpu, threads = placed.split(" ", 1)
    assert applied == f"pinned to CPU {cpu}"
    assert threads == f"[({cpu},)]"  # the main thread and both others: one CPU, the same
    first, second = sorted(os.sched_getaffinity(0))[:2]
    assert widened == f"pinned to CPUs {first}-{second} True" if second == first + 1 else \
        widened == f"pinned to CPUs {first},{second} True"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a CPU this process is kept off")
def test_a_cpu_the_service_may_not_use_is_a_clear_error(capsys):
    cpus = sorted(os.sched_getaffinity(0))
    code = f"""
import os
from services.common import scheduling
os.sched_setaffinity(0, {{{cpus[0]}}})
try:
    scheduling.pin({{{cpus[1]}}})
except scheduling.ConfigError as exc:
    print(exc)
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"--pin-cpu {cpus[1]}: CPU {cpus[1]} is not one this process may use (it may use {cpus[0]})"
    # The services say it, and exit 2 before they load data or listen; a malformed number is a usage error.
    beyond = str(max(cpus) + 1)
    for service in ("services.worker", "services.server"):
        run = subprocess.run([sys.executable, "-m", service, "--pin-cpu", beyond, "--dataset", "synthetic"], cwd=REPO,
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 2, (service, run.stderr)
        assert f"--pin-cpu {beyond}: CPU {beyond} is not one this process may use" in run.stderr, service
        assert "Traceback" not in run.stderr
        # two torch threads kept on one CPU would wait for each other at every step: refused
        crowded = subprocess.run([sys.executable, "-m", service, "--pin-cpu", str(cpus[0]), "--threads", "2",
                                  "--dataset", "synthetic"], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert crowded.returncode == 2, (service, crowded.stderr)
        assert f"--threads 2 with --pin-cpu {cpus[0]}: more torch threads than CPUs" in crowded.stderr, service
        assert "Traceback" not in crowded.stderr
    # a malformed number: the services' own parsers say so (usage errors, exit 2), here without a process each
    from services.server.__main__ import build_parser as server_parser
    from services.worker.__main__ import build_parser as worker_parser

    for parser in (worker_parser(), server_parser()):
        for flag, value, message in (("--pin-cpu", "-1", "a CPU list such as 3, 0-1 or 0,2-3, got '-1'"),
                                     ("--threads", "-2", "must be >= 0, got -2")):
            with pytest.raises(SystemExit) as exited:
                parser.parse_args([flag, value])
            assert exited.value.code == 2 and message in capsys.readouterr().err, (parser.prog, flag)


def test_a_run_folder_that_cannot_be_made_is_a_clear_error_in_every_entry_point(tmp_path, capsys):
    from mdgan_app import cli

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert cli.main(["simulate", "--dataset", "synthetic", "--workers", "2", "--iterations", "1",
                     "--out", str(blocker / "run")]) == 2  # (a setting refused: found before any write)
    err = capsys.readouterr().err
    assert err.startswith("mdgan simulate: error: ") and f"{blocker} is a file, not a folder" in err
    for service, flags in (("services.server", ["--out", str(blocker)]),
                           # after it started serving: its gRPC server is stopped before the loop closes
                           ("services.server", ["--out", str(tmp_path / "server"), "--port-file",
                                                str(blocker / "port"), "--listen", "127.0.0.1:0",
                                                "--metrics-port", "0"]),
                           ("services.worker", ["--state-dir", str(blocker / "state")])):
        run = subprocess.run([sys.executable, "-m", service, *flags, "--insecure", "--dataset", "synthetic"],
                             cwd=REPO, capture_output=True, text=True, timeout=120)
        assert run.returncode == 2, (service, run.stderr)
        assert str(blocker) in run.stderr and "Traceback" not in run.stderr, (service, run.stderr)
        assert "Event loop is closed" not in run.stderr, (service, run.stderr)


def test_a_port_the_service_cannot_bind_is_a_clear_error_and_nothing_is_written(tmp_path):
    """A port taken or a host not this machine's: refused in one line (exit 2) before the run folder (the server's
    --out) or the state folder (a worker's --state-dir) is made."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        for case, (service, flags, message) in enumerate((
                ("services.server", ["--listen", f"127.0.0.1:{port}", "--join-timeout", "5"],
                 f"--listen 127.0.0.1:{port}: cannot listen there"),
                ("services.server", ["--listen", "192.0.2.1:0", "--join-timeout", "5"],
                 "--listen 192.0.2.1:0: cannot listen there"),
                ("services.server", ["--listen", "127.0.0.1:0", "--metrics-port", str(port),
                                     "--metrics-address", "127.0.0.1", "--join-timeout", "5"],
                 f"--metrics-port {port}: cannot serve /metrics on 127.0.0.1:{port} (Address already in use)"),
                ("services.worker", ["--listen", "192.0.2.1:0", "--connect-timeout", "5"],  # not this host's
                 "--listen 192.0.2.1:0: cannot listen there"),
                ("services.worker", ["--metrics-port", str(port), "--metrics-address", "127.0.0.1",
                                     "--connect-timeout", "5"],
                 f"--metrics-port {port}: cannot serve /metrics on 127.0.0.1:{port} (Address already in use)"))):
            folder = tmp_path / f"case-{case}"
            run = subprocess.run([sys.executable, "-m", service, *flags, "--insecure", "--dataset", "synthetic",
                                  "--out" if service == "services.server" else "--state-dir", str(folder)],
                                 cwd=REPO, capture_output=True, text=True, timeout=120)
            assert run.returncode == 2, (service, run.stderr)
            assert message in run.stderr and "Traceback" not in run.stderr, (service, run.stderr)
            assert not folder.exists(), (service, flags, sorted(p.name for p in folder.iterdir()))
    finally:
        taken.close()


def test_ctrl_c_stops_mdgan_simulate_with_one_line(tmp_path):
    simulate = subprocess.Popen([sys.executable, "-m", "mdgan_app.cli", "simulate", "--dataset", "synthetic",
                                 "--workers", "2", "--iterations", "1000000", "--eval-every", "-1", "--no-progress",
                                 "--out", str(tmp_path / "run")], cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True,
                                # as from a terminal: SIGINT at its default (a background test run ignores it)
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "run" / "history.jsonl").exists():  # training
            assert simulate.poll() is None and time.monotonic() < deadline, simulate.communicate()
            time.sleep(0.2)
        os.killpg(simulate.pid, signal.SIGINT)
        _, err = simulate.communicate(timeout=60)
    finally:
        kill_everything(simulate, set())
    assert simulate.returncode == 130
    assert err.strip() == "mdgan simulate: interrupted", err  # no traceback, no warning
