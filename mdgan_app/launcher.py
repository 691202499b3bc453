"""`mdgan local`'s cluster: mdgan-server and N mdgan-worker processes on loopback, started from a fork
server, followed, and stopped (a signal, a failure, the run's end); what the server is given of the
command line. This module never imports gRPC itself: the services do, in their own processes.
"""

from __future__ import annotations

import importlib
import json
import math
import multiprocessing
import os
import random
import shutil
import signal
import socket
import sys
import threading
import time
import urllib.request

from services.common import scheduling
from mdgan.algorithms.base import RUN_FAILED
from mdgan.config import ConfigError
from mdgan_app.cluster_commands import ClusterCommands, security_flags
from mdgan_app.run_folder import save_launch_settings


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out to bind(port 0) and to outgoing connections."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            low, high = (int(v) for v in fh.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _free_ports(count: int, host: str = "127.0.0.1", floor: int = 10000) -> list[int]:
    """`count` distinct ports free on `host` now, chosen outside the kernel's ephemeral range.

    The ports are chosen here and bound later by the services. A port asked of the kernel (bind to
    port 0, then released) comes from the ephemeral range, from which the kernel also takes the
    local port of every outgoing connection and of every `--listen HOST:0`: with fifty workers
    connecting and listening while they start, one of them took a worker's metrics port about one
    run in four. Ports outside that range are only ever taken by someone asking for them by number.
    A random start keeps two launchers started at once apart."""
    low, high = _ephemeral_range()
    candidates = [p for p in range(floor, 65536) if not low <= p <= high]
    if len(candidates) < count:  # the whole range is ephemeral: the kernel's choice, with its race
        candidates = []
    ports: list[int] = []
    start = random.SystemRandom().randrange(len(candidates)) if candidates else 0  # not the run's seed
    for offset in range(len(candidates)):
        port = candidates[(start + offset) % len(candidates)]
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:  # taken, or in TIME_WAIT
                continue
        ports.append(port)
        if len(ports) == count:
            return ports
    for _ in range(3 * count + 100):  # the kernel hands out the same few ports again when it runs short
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in ports:
            ports.append(port)
            if len(ports) == count:
                return ports
    raise ConfigError(f"only {len(ports)} of the {count} ports the services need are free on {host}")


# Every service of a local cluster is forked from one "zygote" (multiprocessing's fork server) that
# imported torch, gRPC and both services once: N workers then share those pages copy-on-write
# instead of each paying ~300 MB and seconds of imports. The fork server is single-threaded when it
# forks (it has created no gRPC channel, event loop or torch thread pool), which makes fork safe.
FORK_SERVER_PRELOAD = "mdgan_app.preload"
LOG_TAIL_LINES = 20
MACHINE_PORTS = 65535 - 1023  # the TCP ports above the privileged ones


class Terminated(Exception):
    """A termination signal (SIGTERM, SIGHUP; SIGINT too) reached `mdgan local`."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class ServiceFailed(RuntimeError):
    """A service exited before the run started."""


def _become_service(log_path: str) -> None:
    """The start of a forked service: log to its file, follow its parent's death, default signals."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # Its own process group: a Ctrl-C at the terminal reaches the launcher only, which stops the
    # services in order; and a service dies with the fork server (itself tied to the launcher).
    os.setpgid(0, 0)
    scheduling.die_with_parent()
    _release_fork_server()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # tqdm's default lock is a multiprocessing semaphore, registered with the launcher's resource
    # tracker: a service killed outright could not unregister it, and the tracker warned of a "leaked
    # semaphore" as `mdgan local` ended. A service shows no bar; a thread lock does.
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


def _release_fork_server() -> None:
    """Close this child's copy of the write end of the fork server's "alive" pipe.

    The fork server exits when that pipe's write end is closed everywhere, which is how it learns
    that the launcher is gone; but multiprocessing hands a copy to every child it forks (so a child
    could start processes through it too, which services never do). With those copies open, a
    launcher killed outright (SIGKILL, the OOM killer) left the fork server waiting, and with it every
    service, which dies with the fork server (die_with_parent): the run went on, orphaned, to its end.
    (`_forkserver_alive_fd` is multiprocessing's own, private but there since Python 3.4.)"""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
        server._forkserver_alive_fd = None


def _run_service(module: str, argv: list[str], log_path: str) -> None:
    """The body of a forked service: its main()."""
    _become_service(log_path)
    main = importlib.import_module(f"{module}.__main__").main
    sys.exit(main(argv))


def _run_worker_group(members: list, log_path: str, status_path: str) -> None:
    """The body of a forked process of several workers (services/worker/group.py)."""
    _become_service(log_path)
    from services.worker import group

    sys.exit(group.main(members, status_path))


def _how_it_ended(exitcode: int) -> str:
    """A process's exit code in words (multiprocessing gives -N for a death by signal N)."""
    return f"was killed by {signal.Signals(-exitcode).name}" if exitcode < 0 else f"exited with code {exitcode}"


def _log_tail(path: str, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, errors="replace") as fh:
            return "".join(fh.readlines()[-lines:]).rstrip()
    except OSError as exc:
        return f"(no log: {exc})"


def last_log_message(path: str) -> str:
    """The message of a service's last log line, without its time, logger and level ("" if none): a
    service that fails ends its log with one line that says why."""
    last = _log_tail(path, 1)
    parts = last.split(" ", 4)  # date, time, logger, level, message (services' LOG_FORMAT)
    return parts[4] if len(parts) == 5 and parts[3] in ("ERROR", "WARNING", "INFO", "CRITICAL") else last


def _complete_lines(path: str) -> int:
    """Complete lines of a file being appended to (0: none yet)."""
    try:
        with open(path, "rb") as fh:
            return fh.read().count(b"\n")
    except OSError:
        return 0


def _scrape(port: int, *names: str) -> dict[str, float]:
    """Values of a Prometheus exposition (the server's own metrics) by sample name; {} when unreachable."""
    found = {}
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as reply:
            for line in reply.read().decode().splitlines():
                name, _, value = line.partition(" ")
                if name in names:
                    found[name] = float(value.split()[0])
    except (OSError, ValueError):
        return {}
    return found


class LocalCluster:
    """A server and N worker processes on loopback; every process logs to DIR/logs/.

    The launcher supervises them: a service that exits before the run starts stops the whole
    cluster (its name and the tail of its log are reported); one that ends with an error or is
    killed after the start is reported in a line, and the run goes on with the others; termination
    signals stop them all.
    """

    def __init__(self, args):
        self.args = args
        self.out = os.path.abspath(args.out)
        self.logs = os.path.join(self.out, "logs")
        self.processes: list[tuple[str, multiprocessing.Process]] = []
        self.metrics_ports: dict[str, int] = {}
        self.groups: dict[str, list[str]] = {}  # a process of several workers -> their names
        self._reported: set[str] = set()  # workers (and processes) whose early end was told
        self._context = multiprocessing.get_context("forkserver")
        # (not mdgan_app.cli itself: multiprocessing runs the launcher's main module again in each child)
        self._context.set_forkserver_preload([FORK_SERVER_PRELOAD])

    def log_path(self, name: str) -> str:
        return os.path.join(self.logs, f"{name}.log")

    def status_path(self, process_name: str) -> str:
        """Where a process of several workers writes its workers' exit codes."""
        return os.path.join(self.logs, f"{process_name}.status.json")

    def _spawn(self, name: str, argv: list[str]) -> multiprocessing.Process:
        module, *rest = argv
        process = self._context.Process(target=_run_service, args=(module, rest, self.log_path(name)),
                                        name=name, daemon=True)
        self._start(name, process)
        return process

    def _start(self, name: str, process: multiprocessing.Process) -> None:
        """Start the process and count it as the cluster's; a stop that comes meanwhile is handled once it is
        (scheduling.signals_held: never between its fork and the sending of what it is to run)."""
        with scheduling.signals_held(signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            process.start()
            self.processes.append((name, process))

    def _spawn_workers(self, workers: list[tuple[str, list[str]]]) -> None:
        """Worker processes of `workers_per_process(...)` workers each: alone, a worker is an
        mdgan-worker process; several share a process (services/worker/group.py)."""
        from services.worker.group import Member

        size = workers_per_process(self.args.workers, self.args.workers_per_process)
        starts = range(0, len(workers), size)
        placements = scheduling.worker_cpus(len(starts), self.args.pin_workers, self.args.threads)
        for start, cpus in zip(starts, placements):
            # a process's: its workers all say the same
            pinned = [] if cpus is None else ["--pin-cpu", scheduling.cpu_list(cpus)]
            chunk = [(name, [*argv, *pinned]) for name, argv in workers[start:start + size]]
            if len(chunk) == 1:
                (name, argv), = chunk
                self._spawn(name, ["services.worker", *argv])
                continue
            name = f"workers-{start}-{start + len(chunk) - 1}"
            members = [Member(member, argv, self.log_path(member)) for member, argv in chunk]
            process = self._context.Process(target=_run_worker_group,
                                            args=(members, self.log_path(name), self.status_path(name)),
                                            name=name, daemon=True)
            self.groups[name] = [member for member, _ in chunk]
            self._start(name, process)

    def write_targets(self, groups: list[dict]) -> None:
        """metrics_targets.json, replaced atomically (Prometheus may read it at any moment)."""
        from mdgan.checkpoint import atomic_write_json

        atomic_write_json(os.path.join(self.out, "metrics_targets.json"), groups)

    def start(self) -> multiprocessing.Process:
        from mdgan.attacks import attackers

        a = self.args
        # An earlier run's logs and exit codes here would be read as this run's (a worker "failed"
        # before it started); each service truncates its own log anyway. Resumed, the run's own logs
        # from before are kept aside: they say why it stopped.
        if a.resume:
            try:
                keep_earlier_logs(self.logs, os.path.join(self.out, EARLIER_LOGS))
            except OSError as exc:  # (a full disk, a read-only folder): the resume matters more
                print(f"mdgan local: could not keep the earlier logs: {exc}", file=sys.stderr)
        shutil.rmtree(self.logs, ignore_errors=True)
        os.makedirs(self.logs, exist_ok=True)
        security = security_flags(a, self.out)
        port_file = os.path.join(self.out, "server.port")
        # from an earlier run here (a resumed run keeps its history: the server truncates it to the checkpoint)
        stale = ("server.port",) if a.resume else ("server.port", "history.jsonl", "swaps.jsonl", "summary.json")
        for name in stale:
            if os.path.exists(os.path.join(self.out, name)):
                os.remove(os.path.join(self.out, name))
        if not a.resume:  # the workers' states of an earlier run here would tie them to that run
            shutil.rmtree(os.path.join(self.out, "workers"), ignore_errors=True)
        save_launch_settings(a)  # what --resume takes again (resumed: as it goes on now, a moved data root say)
        names = ["server", *(f"worker-{i}" for i in range(a.workers))]
        metrics_ports = dict(zip(names, _free_ports(len(names))))
        self.metrics_ports = metrics_ports
        # Prometheus file_sd targets, so a Prometheus can scrape this cluster while it runs.
        self.write_targets([{"targets": [f"127.0.0.1:{port}"],
                             "labels": {"job": "mdgan-server" if name == "server" else "mdgan-worker",
                                        "process": name}}
                            for name, port in metrics_ports.items()])
        commands = ClusterCommands(a, self.out)
        server = self._spawn("server", commands.server(port_file, security["server"], metrics_ports["server"]))
        port = self._wait_for_port(port_file, 120)
        attacking = set(attackers(a.workers, a.byzantine)) if a.attack else set()
        workers = [(name, commands.worker(index, port, index in attacking, security[name], metrics_ports[name]))
                   for index, name in enumerate(names[1:])]
        self._spawn_workers(workers)
        return server

    def _wait_for_port(self, path: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if os.path.exists(path):
                with open(path) as fh:
                    return fh.read().strip()
            self.check_children(started=False)
            time.sleep(0.05)
        raise ServiceFailed(f"the server did not start within {timeout:.0f} s")

    def check_children(self, started: bool) -> None:
        """Before the run starts, any service that fails fails the cluster; afterwards, only the
        server's exit ends the run (a worker lost mid-run is the algorithm's business). An exit with
        code 0 is a run that ended (a run of a few iterations can end between two looks), not a failure.
        A worker in a process of several is watched on its own, through the process's status file."""
        for name, process in self.processes:
            if started and name != "server":
                continue
            for member, code in self.member_codes(name).items():
                if code not in (None, 0):
                    raise ServiceFailed(f"{member} (in process {name}) {_how_it_ended(code)} before the run "
                                        f"started; the end of {self.log_path(member)}:\n"
                                        f"{_log_tail(self.log_path(member))}")
            if process.exitcode not in (None, 0):
                code = process.exitcode
                raise ServiceFailed(f"{name} {_how_it_ended(code)} before the run started; the end of "
                                    f"{self.log_path(name)}:\n"
                                    f"{_log_tail(self.log_path(name))}")

    def departures(self, iteration: int | None) -> list[str]:
        """One line for each worker that ended with an error or was killed since the last look,
        after the start. The run goes on without it (losing workers mid-run is the algorithm's
        business, Figure 5's crashes), but an operator must not learn it only from workers_alive:
        the line names the worker, how it ended, when, and its log (with an error's last line)."""
        when = f"at iteration {iteration}" if iteration else "after the start"
        lines = []

        def tell(worker: str, code: int, log_name: str) -> None:
            last = last_log_message(self.log_path(log_name)) if code > 0 else ""  # (a signal leaves no error line)
            if last.startswith(RUN_FAILED):  # it left because the server failed: the server's line says why
                return
            lines.append(f"{worker} {_how_it_ended(code)} {when}; the run goes on with the other workers "
                         f"(log: {self.log_path(log_name)}){': ' + last if last else ''}")

        for name, process in self.processes:
            if name == "server":
                continue
            members = self.member_codes(name)
            for member, code in members.items():  # a worker of several that ended by itself
                if code not in (None, 0) and member not in self._reported:
                    self._reported.add(member)
                    tell(f"{member} (in process {name})", code, member)
            code = process.exitcode
            if code in (None, 0) or name in self._reported:
                continue
            self._reported.add(name)
            if not members:
                tell(name, code, name)
                continue
            with_it = [m for m in members if m not in self._reported]  # ended with their process
            self._reported.update(with_it)
            if with_it:
                tell(f"process {name} ({', '.join(with_it)})", code, name)
        return lines

    def member_codes(self, process_name: str) -> dict[str, int | None]:
        """The exit code of each worker of a process of several (None: running or unknown); {} for a
        process of one service."""
        if process_name not in self.groups:
            return {}
        from mdgan.checkpoint import read_json

        try:
            saved = read_json(self.status_path(process_name))
        except (OSError, ValueError):  # not written yet
            saved = {}
        return {member: saved.get(member) for member in self.groups[process_name]}

    def follow(self, server: multiprocessing.Process) -> int:
        """Show the workers joining, then progress from history.jsonl (read incrementally), until the
        server exits. Raises ServiceFailed when a service exits before the run starts."""
        from tqdm import tqdm

        history = os.path.join(self.out, "history.jsonl")
        # (a resumed run's history holds its earlier lines, cut back to its checkpoint before the server
        # serves: a line more than now is an iteration of this start)
        lines_before = _complete_lines(history)
        quiet = self.args.no_progress or not sys.stderr.isatty()  # bars on a terminal only
        with tqdm(total=self.args.workers, desc="workers joined", unit="worker", disable=quiet) as bar:
            joined, last_note = 0, time.monotonic()
            while server.exitcode is None:  # (a server done before we looked: its exit code says how it went)
                values = _scrape(self.metrics_ports["server"], "mdgan_workers_alive", "mdgan_iterations_total")
                # Started once an iteration is done: history.jsonl is there from the start (and, resumed,
                # holds the lines before), and a worker lost after the start is the run's business.
                if values.get("mdgan_iterations_total", 0) > 0:
                    break
                try:
                    self.check_children(started=False)
                except ServiceFailed:
                    # Started since we looked? Then that worker left a run under way (told below), and
                    # the run goes on: the run may have started up to a poll before it died. A server
                    # killed just after its first iteration answers no scrape: its history says it.
                    if _scrape(self.metrics_ports["server"], "mdgan_iterations_total").get(
                            "mdgan_iterations_total", 0) > 0 or _complete_lines(history) > lines_before:
                        break
                    raise
                alive = values.get("mdgan_workers_alive")
                if alive is not None and int(alive) != joined:
                    bar.update(int(alive) - joined)
                    joined = int(alive)
                if quiet and time.monotonic() - last_note >= 10:  # never silent, even without a bar
                    print(f"mdgan local: {joined} of {self.args.workers} workers joined", file=sys.stderr)
                    last_note = time.monotonic()
                time.sleep(0.2)
            bar.update(self.args.workers - joined)
        pending, handle, iteration = "", None, None
        with tqdm(total=self.args.iterations, desc="mdgan local", unit="it", disable=quiet) as bar:
            try:
                while True:
                    done = server.exitcode is not None
                    if handle is None and os.path.exists(history):
                        handle = open(history, encoding="utf-8")
                    if handle is not None:
                        pending += handle.read()
                        *lines, pending = pending.split("\n")
                        if lines:
                            last = json.loads(lines[-1])
                            iteration = last.get("iteration", iteration)
                            bar.update(len(lines))
                            bar.set_postfix(workers=last.get("active_workers"), refresh=False)
                    for line in self.departures(iteration):
                        bar.write(f"mdgan local: {line}", file=sys.stderr)
                    if done:
                        return server.exitcode
                    time.sleep(0.2)
            finally:
                if handle is not None:
                    handle.close()

    @staticmethod
    def _signal(process: multiprocessing.Process, sig: int) -> None:
        try:
            os.killpg(process.pid, sig)  # the service and anything it started
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(process.pid, sig)
            except ProcessLookupError:
                pass

    def _signal_all(self, sig: int) -> None:
        for _, process in self.processes:
            if process.exitcode is None:
                self._signal(process, sig)

    def _stop_server_first(self) -> None:
        """SIGTERM the server and give it its stop grace to checkpoint the iteration under way: the workers
        must still be there to write their states, or that checkpoint is incomplete and a resume goes back
        to the one before."""
        servers = [process for name, process in self.processes if name == "server" and process.exitcode is None]
        for process in servers:
            self._signal(process, signal.SIGTERM)
            process.join(3.0)
            if process.exitcode is None:  # an iteration or a checkpoint under way: say why the stop waits
                grace = self.args.stop_grace  # (its workers are still up: they must write their states too)
                print(f"mdgan local: waiting up to {grace + 2:.0f} s more for the server to checkpoint "
                      "where it stopped", file=sys.stderr)
                process.join(grace + 2.0)

    def stop(self, grace: float = 30.0, terminate: bool = False) -> dict[str, int | None]:
        """Wait for every service to end (up to `grace` s; at once with terminate=True they are sent
        SIGTERM first); then SIGTERM, and SIGKILL 5 s later, whatever is still running."""
        if os.path.exists(os.path.join(self.out, "metrics_targets.json")):
            try:
                self.write_targets([])  # the processes are gone: nothing left to scrape
            except OSError as exc:  # (a full disk): the processes must be stopped all the same
                print(f"mdgan local: {exc}", file=sys.stderr)
        if terminate:
            self._stop_server_first()
            self._signal_all(signal.SIGTERM)
        for escalate, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0), (None, 5.0)):
            deadline = time.monotonic() + wait
            for _, process in self.processes:
                process.join(max(0.0, deadline - time.monotonic()))
            if all(p.exitcode is not None for _, p in self.processes) or escalate is None:
                break
            self._signal_all(escalate)
        _stop_multiprocessing_helpers()
        codes: dict[str, int | None] = {}
        for name, process in self.processes:
            members = self.member_codes(name)
            if not members:
                codes[name] = process.exitcode
            for member, code in members.items():  # a worker killed with its process: the process's code
                codes[member] = process.exitcode if code is None else code
        return codes


EARLIER_LOGS = "earlier-logs"  # RUN/earlier-logs/<UTC time>/: the logs of a resumed run's earlier starts
EARLIER_LOGS_KEPT = 5


def keep_earlier_logs(logs: str, earlier: str, keep: int = EARLIER_LOGS_KEPT,
                      now: time.struct_time | None = None) -> None:
    """Move what `logs` holds into earlier/<UTC time (now)>/, keeping the newest `keep` such folders."""
    try:
        if not os.listdir(logs):
            return
    except FileNotFoundError:
        return
    os.makedirs(earlier, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", now or time.gmtime())
    target, n = os.path.join(earlier, stamp), 1
    while os.path.exists(target):  # two starts in one second
        n += 1
        target = os.path.join(earlier, f"{stamp}-{n}")
    os.replace(logs, target)
    for old in sorted(os.listdir(earlier))[:-keep]:
        shutil.rmtree(os.path.join(earlier, old), ignore_errors=True)


def _stop_multiprocessing_helpers() -> None:
    """End multiprocessing's helper processes now: the fork server and the resource tracker. Each
    ends by itself when its pipe from the launcher closes, but that happens only as the launcher's
    process exits, so they outlived `mdgan local` by a moment. (`_stop` is multiprocessing's own
    way, private but there since Python 3.8: it closes the pipe and reaps the helper; SIGKILL after
    5 s bounds that wait.)"""
    from multiprocessing import forkserver, resource_tracker

    for helper, pid_attribute in ((getattr(forkserver, "_forkserver", None), "_forkserver_pid"),
                                  (getattr(resource_tracker, "_resource_tracker", None), "_pid")):
        pid = getattr(helper, pid_attribute, None)
        if pid is None or not hasattr(helper, "_stop"):
            continue

        def kill(pid: int = pid) -> None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

        timer = threading.Timer(5.0, kill)
        timer.start()
        try:
            helper._stop()
        except OSError:  # already gone (ChildProcessError)
            pass
        finally:
            timer.cancel()


def usable_cores() -> int:
    return len(scheduling.usable_cpus())


def workers_per_process(workers: int, asked: int) -> int:
    """`--workers-per-process`: K as asked, or (0) as many as make one worker process per usable core."""
    if asked < 0:
        raise ConfigError(f"--workers-per-process must be >= 0, got {asked}")
    if asked:
        return asked
    return max(1, math.ceil(workers / usable_cores()))


def _raise_terminated(signum, frame):
    raise Terminated(signum)

