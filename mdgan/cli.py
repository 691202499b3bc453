"""The `mdgan` command: run a local gRPC cluster, simulate in one process, list the models.

`mdgan local` starts the real services (mdgan-server and N mdgan-worker processes) on loopback;
this module never imports gRPC itself.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
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
import warnings

from mdgan import scheduling
from mdgan.config import GAN_KINDS, SPLITS, ConfigError, ModelSpec

TRAINING_FLAGS = ("workers", "iterations", "batch_size", "kappa", "disc_steps", "swap_epochs", "swap_every",
                  "seed", "architecture", "gan", "loss", "gen_lr", "disc_lr", "beta1", "beta2",
                  "wire_dtype", "aggregation", "trim_fraction", "clip_norm", "sync", "quorum", "max_staleness")


def _print_summary(summary: dict) -> None:
    keys = ("mode", "iterations", "workers", "workers_alive", "wall_seconds", "seconds_per_iteration",
            "generator_sha256", "payload_bytes", "swaps", "final")
    print(json.dumps({k: summary.get(k) for k in keys}, indent=2))


RUN_DIR_LOCK = ".mdgan.lock"


@contextlib.contextmanager
def run_dir_lock(out: str, command: str):
    """Keep `out` ours while a run writes there: a second `mdgan local` or `simulate` in the same
    folder would remove the first's logs and overwrite its history, summary and checkpoints."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, RUN_DIR_LOCK), "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "another process"
            raise ConfigError(f"--out {out}: a run is under way there ({holder}); wait for it to end, or choose "
                              f"another --out") from None
        fh.seek(0)
        fh.truncate()
        fh.write(f"mdgan {command}, pid {os.getpid()}")
        fh.flush()
        yield  # (the lock goes with the file's closing, or the process's death)


def cmd_simulate(args) -> int:
    from mdgan.algorithms.options import dpgan_options, pwgan_options
    from mdgan.run import simulate
    from mdgan.settings import class_names, configure_compute, data_config, evaluation_options, training_config

    from mdgan.run import parse_churn

    if args.resume:
        take_launch_settings(args)
    configure_compute(args.threads)
    _resolve_workers(args)
    config = training_config(args)
    with run_dir_lock(args.out, "simulate"):
        save_launch_settings(args)
        summary = simulate(
            config, data_config(args, config.workers), args.out, progress=not args.no_progress,
            evaluation=evaluation_options(args, _eval_root(args)), algorithm=args.algorithm,
            churn=parse_churn(args.churn), checkpoint_every=args.checkpoint_every,
            keep_checkpoints=args.keep_checkpoints, resume="yes" if args.resume else "no",
            run_id=args.run_id, site_dirs=args.site_dirs, bad_images=args.bad_images, classes=class_names(args),
            byzantine=args.byzantine, attack=args.attack,
            pwgan=pwgan_options(args), dpgan=dpgan_options(args, config.workers))
    _print_summary(summary)
    print(f"run directory: {args.out}")
    return 0


def _resolve_workers(args) -> None:
    """--workers: the number of site folders with --site-dirs (which an explicit --workers must match), else 4."""
    from mdgan.sites import count_sites

    if args.site_dirs:
        sites = count_sites(args.site_dirs)
        if args.workers is not None and args.workers != sites:
            raise ConfigError(f"--workers {args.workers}, but --site-dirs {args.site_dirs} holds {sites} sites")
        args.workers = sites
    elif args.workers is None:
        args.workers = 4


def _eval_root(args) -> str | None:
    """Scores need the MNIST test set: only for MNIST runs (with --site-dirs, --data-root may still hold it)."""
    if args.dataset == "mnist" and args.eval_every >= 0 and not args.site_dirs:
        return args.data_root
    if args.eval_every >= 0 and args.site_dirs and os.path.isdir(os.path.join(args.data_root, "MNIST", "raw")):
        return args.data_root
    return None


def _forwarded_training_flags(args) -> list[str]:
    flags = []
    for dest in TRAINING_FLAGS:
        value = getattr(args, dest)
        if value is not None:
            flags += [f"--{dest.replace('_', '-')}", str(value)]
    if args.swap_optimizer_state:
        flags.append("--swap-optimizer-state")
    return flags


def _forwarded_algorithm_flags(args) -> list[str]:
    """The options of the run's algorithm (mdgan/algorithms/options.py), for mdgan-server."""
    if args.algorithm == "pwgan":
        return ["--potential-rounds", str(args.potential_rounds), "--potential-lr", repr(args.potential_lr),
                "--gradient-penalty", repr(args.gradient_penalty)]
    if args.algorithm == "dpgan" and args.dp_threshold is not None:
        return ["--dp-threshold", str(args.dp_threshold)]
    return []


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
FORK_SERVER_PRELOAD = "services.common.preload"
LOG_TAIL_LINES = 20
SERVER_STOP_GRACE = 20.0  # s a SIGTERM'd server has to checkpoint the iteration under way, its workers still up
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
        # (not mdgan.cli itself: multiprocessing runs the launcher's main module again in each child)
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
        process.start()
        self.processes.append((name, process))
        return process

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
            process.start()
            self.processes.append((name, process))
            self.groups[name] = [member for member, _ in chunk]

    def write_targets(self, groups: list[dict]) -> None:
        """metrics_targets.json, replaced atomically (Prometheus may read it at any moment)."""
        from mdgan.checkpoint import atomic_write_json

        atomic_write_json(os.path.join(self.out, "metrics_targets.json"), groups)

    def _metrics_flags(self, name: str, port: int) -> list[str]:
        return ["--metrics-port", str(port), "--metrics-address", "127.0.0.1",
                "--metrics-dump", os.path.join(self.out, "metrics", f"{name}.prom")]

    def security_flags(self) -> dict[str, list[str]]:
        """Per process: the --tls-* flags of a throwaway PKI made in RUN/tls/ (a new CA every run), or
        --insecure for everyone when the user asked for plaintext."""
        names = ["server", *(f"worker-{i}" for i in range(self.args.workers))]
        if self.args.insecure:
            return {name: ["--insecure"] for name in names}
        from services.common import pki  # cryptography only; no gRPC here

        directory = os.path.join(self.out, "tls")
        identities = {"server": "mdgan-server", **{n: n for n in names[1:]}}
        issued = pki.provision_run(directory, names[1:], server=identities["server"])
        return {name: ["--tls-ca", issued[identities[name]]["ca"], "--tls-cert", issued[identities[name]]["cert"],
                       "--tls-key", issued[identities[name]]["key"]] for name in names}

    def start(self) -> multiprocessing.Process:
        from mdgan.attacks import attackers
        from mdgan.sites import site_dir

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
        security = self.security_flags()
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
        server = self._spawn("server", [
            "services.server", "--listen", "127.0.0.1:0", "--port-file", port_file, "--out", self.out,
            "--threads", str(a.threads), "--cpu-scheduling", a.cpu_scheduling,  # few cores for many: batch
            "--device", a.device, "--step-timeout", str(a.step_timeout),
            "--swap-timeout", str(a.swap_timeout), "--join-timeout", str(a.join_timeout),
            "--heartbeat-interval", str(a.heartbeat_interval), *self._metrics_flags("server", metrics_ports["server"]),
            "--eval-every", str(a.eval_every), "--eval-samples", str(a.eval_samples),
            "--eval-reference", str(a.eval_reference), "--dataset", a.dataset, "--algorithm", a.algorithm,
            "--checkpoint-every", str(a.checkpoint_every), "--keep-checkpoints", str(a.keep_checkpoints),
            "--stop-grace", str(SERVER_STOP_GRACE),
            *(["--resume", "yes"] if a.resume else []), *(["--run-id", a.run_id] if a.run_id else []),
            *security["server"],
            *(["--eval-data-root", _eval_root(a)] if _eval_root(a) else []),
            *(["--classes", a.classes] if a.classes else []), *_forwarded_training_flags(a),
            *_forwarded_algorithm_flags(a)])
        port = self._wait_for_port(port_file, 120)
        attacking = set(attackers(a.workers, a.byzantine)) if a.attack else set()
        workers = []
        for index in range(a.workers):
            name = f"worker-{index}"
            if a.site_dirs:  # a site: worker i is given its own folder, nothing else
                data = ["--data-root", site_dir(os.path.abspath(a.site_dirs), index), "--bad-images", a.bad_images]
            else:  # emulation: every worker is given the shared dataset and keeps shard i
                data = ["--num-shards", str(a.workers), "--data-root", a.data_root, "--split-seed", str(a.split_seed),
                        "--split", a.split, "--dirichlet-alpha", str(a.dirichlet_alpha)]
            workers.append((name, [
                "--server", f"127.0.0.1:{port}", "--listen", "127.0.0.1:0",
                "--advertise-address", "127.0.0.1", "--shard-index", str(index), "--dataset", a.dataset, *data,
                "--threads", str(a.threads), "--cpu-scheduling", a.cpu_scheduling, "--device", a.device,
                "--server-timeout", str(a.step_timeout + 60),
                "--state-dir", os.path.join(self.out, "workers", name),
                *(["--attack", a.attack] if index in attacking else []),
                *security[name], *self._metrics_flags(name, metrics_ports[name])]))
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
            last = _log_tail(self.log_path(log_name), 1) if code > 0 else ""  # (a signal leaves no error line)
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
        quiet = self.args.no_progress
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
                    # the run goes on: the run may have started up to a poll before it died.
                    if _scrape(self.metrics_ports["server"], "mdgan_iterations_total").get(
                            "mdgan_iterations_total", 0) > 0:
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
                print(f"mdgan local: waiting up to {SERVER_STOP_GRACE + 2:.0f} s more for the server to checkpoint "
                      "where it stopped", file=sys.stderr)
                process.join(SERVER_STOP_GRACE + 2.0)

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


LAUNCH_FILE = "launch.json"  # `mdgan local`'s or `simulate`'s settings of the run in a folder, for --resume
_NOT_LAUNCH_SETTINGS = {"command", "func", "given", "out", "resume", "run_id"}
_PATH_SETTINGS = ("data_root", "site_dirs")  # saved absolute: a resume may start from another folder


def save_launch_settings(args) -> None:
    """RUN/launch.json: every setting of this `mdgan local` or `simulate` but where it writes and whether
    it resumes."""
    from mdgan.checkpoint import atomic_write_json

    settings = {key: value for key, value in sorted(vars(args).items()) if key not in _NOT_LAUNCH_SETTINGS}
    for key in _PATH_SETTINGS:
        if settings.get(key):
            settings[key] = os.path.abspath(settings[key])
    atomic_write_json(os.path.join(args.out, LAUNCH_FILE), settings)


def _check_launch_setting(args, key: str, value) -> None:
    """A saved setting must be of its option's kind (an edited launch.json): a number where a number
    is, and so on; what it may be beyond that, the checks of a fresh launch say."""
    default = getattr(args, key)
    if default is None or value is None:
        return

    def kind(v) -> str:  # (an int default may stand for a float option: numbers are one kind)
        return "bool" if isinstance(v, bool) else "number" if isinstance(v, (int, float)) else type(v).__name__

    if kind(value) != kind(default):
        raise ConfigError(f"--resume {args.resume}: {LAUNCH_FILE}: {key} is {value!r}, not a "
                          f"{kind(default)} like its option's (edit it, or give --{key.replace('_', '-')})")


def take_launch_settings(args) -> None:
    """--resume RUN: the run goes on as it was launched (its data, split, evaluation, checkpoints,
    timeouts, security...), but for what this command gives (a moved --data-root, --threads, ...).
    Before, only its workers and iterations were taken: a run of synthetic data or another data root
    resumed with the defaults' data (or failed), and without --checkpoint-every never checkpointed again."""
    from mdgan.checkpoint import RUN_FILE, read_json

    args.out = args.resume
    try:
        saved = read_json(os.path.join(args.resume, RUN_FILE))
    except FileNotFoundError:
        raise ConfigError(f"--resume {args.resume}: no run to resume there (no {RUN_FILE})") from None
    try:
        launched = read_json(os.path.join(args.resume, LAUNCH_FILE))
    except FileNotFoundError:  # launched by an older mdgan
        launched = {}
        print(f"mdgan {args.command}: {args.resume} has no {LAUNCH_FILE} (an older mdgan launched it): its training "
              "settings are its own, the others (data, evaluation, checkpoints) this command's", file=sys.stderr)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--resume {args.resume}: {LAUNCH_FILE} is unreadable: {exc}") from None
    if not isinstance(launched, dict):
        raise ConfigError(f"--resume {args.resume}: {LAUNCH_FILE} holds no settings (a JSON object is expected)")
    given = getattr(args, "given", set())
    for key, value in launched.items():
        if key not in given and key not in _NOT_LAUNCH_SETTINGS and hasattr(args, key):
            _check_launch_setting(args, key, value)
            setattr(args, key, value)
    for key in ("workers", "iterations"):  # the run's own: its checkpoints are of that many
        if key in given and getattr(args, key) != saved["config"][key]:
            raise ConfigError(f"--resume {args.resume}: the run has {key} {saved['config'][key]}; --{key} "
                              f"{getattr(args, key)} cannot change it (start a new run with --out elsewhere)")
        setattr(args, key, saved["config"][key])


def cmd_local(args) -> int:
    from mdgan.settings import training_config

    if args.resume:  # the run's own settings, from its run directory
        take_launch_settings(args)
    _resolve_workers(args)
    training_config(args)  # fail here, with a clear message, rather than in a child process
    if bool(args.byzantine) != bool(args.attack):
        raise ConfigError("--byzantine K and --attack go together")
    if args.byzantine:
        from mdgan.attacks import attackers

        attackers(args.workers, args.byzantine)
    if args.algorithm == "standalone":
        raise ConfigError("a standalone GAN has no workers: run it with `mdgan simulate --algorithm standalone`")
    if args.algorithm == "pwgan":  # refused here, with a clear message, rather than in the server
        from mdgan.algorithms.options import pwgan_options
        from mdgan.algorithms.pwgan import check_config

        pwgan_options(args)
        check_config(training_config(args))
        if args.checkpoint_every or args.resume:
            raise ConfigError("checkpoints and resume work with --algorithm mdgan only")
    if args.algorithm == "dpgan":
        from mdgan.algorithms.options import dpgan_options

        dpgan_options(args, args.workers)  # a bad --dp-threshold fails here, not in the server
        if args.checkpoint_every or args.resume:
            raise ConfigError("checkpoints and resume work with --algorithm mdgan only")
        if args.byzantine:
            raise ConfigError("emulated attackers (--byzantine) apply to MD-GAN runs")
    workers_per_process(args.workers, args.workers_per_process)  # a bad value fails here
    needed = 2 * args.workers + 2  # each service's /metrics, each worker's Peer service, the server's gRPC
    if needed > MACHINE_PORTS:
        raise ConfigError(f"--workers {args.workers}: a cluster on one machine needs {needed} ports (a /metrics "
                          f"port and a Peer service port per worker) and a machine has {MACHINE_PORTS}")
    with run_dir_lock(args.out, "local"):
        return _run_local(args)


def _run_local(args) -> int:
    cluster = LocalCluster(args)
    previous = {sig: signal.signal(sig, _raise_terminated) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    terminate = stop_now = False  # terminate: a signal, or a failure before the start (both said already)
    try:
        server = cluster.start()
        code = cluster.follow(server)
        # A server that failed stopped no worker: they would try to reconnect until the grace ran out.
        stop_now = code != 0
    except Terminated as exc:
        print(f"mdgan local: {exc}: stopping the cluster", file=sys.stderr)
        code, terminate = 128 + exc.signum, True
    except ServiceFailed as exc:
        print(f"mdgan local: {exc}\nmdgan local: stopping the cluster; logs in {cluster.logs}", file=sys.stderr)
        code, terminate = 1, True
    finally:
        # A second signal while we stop must not leave processes behind: stop() runs to the end.
        for sig in previous:
            signal.signal(sig, signal.SIG_IGN)
        now = terminate or stop_now
        try:
            codes = cluster.stop(grace=10.0 if now else 30.0, terminate=now)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    if code != 0:
        if not terminate:
            print(f"mdgan local: the server {_how_it_ended(code)}; the end of its log:\n"
                  f"{_log_tail(cluster.log_path('server'))}\nlogs in {cluster.logs}", file=sys.stderr)
        return code if code > 0 else 1  # (a signal's negative code is no exit status)
    with open(os.path.join(cluster.out, "summary.json")) as fh:
        summary = json.load(fh)
    summary["mode"] = "local"
    summary["exit_codes"] = codes
    from mdgan.checkpoint import atomic_write_json

    atomic_write_json(os.path.join(cluster.out, "summary.json"), summary)
    _print_summary(summary)
    print(f"run directory: {args.out}")
    return 0


def cmd_certs(args) -> int:
    # cryptography only; imported here so that other commands do not need it
    from services.common import pki

    try:
        if args.certs_command == "init":
            path = pki.init_ca(args.dir, days=args.days, overwrite=args.overwrite)
            print(f"CA certificate: {path}\nCA key:         {pki.ca_paths(args.dir)[1]}  (keep it safe; only "
                  f"`mdgan certs issue` needs it)")
        else:
            role = "server" if args.server else "worker"
            paths = pki.issue(args.dir, args.name, role, sans=args.san, days=args.days, overwrite=args.overwrite)
            print(f"{role} {args.name}: --tls-ca {paths['ca']} --tls-cert {paths['cert']} --tls-key {paths['key']}")
    except pki.PKIError as exc:
        raise ConfigError(str(exc)) from None
    return 0


def cmd_split(args) -> int:
    from mdgan.config import DataConfig
    from mdgan.sites import split_to_sites

    data = DataConfig(args.dataset, args.data_root, args.workers, args.split_seed, split=args.split,
                      dirichlet_alpha=args.alpha).validate()
    sites = split_to_sites(data, args.out, samples=args.samples)
    print(json.dumps(sites, indent=2))
    print(f"{len(sites)} site folders in {args.out}: train on them with "
          f"`mdgan local --dataset imagefolder --site-dirs {args.out}`", file=sys.stderr)
    return 0


def cmd_models(args) -> int:
    from mdgan.models import ARCHITECTURES, parameter_report

    report = {arch: {gan: parameter_report(ModelSpec(architecture=arch, gan=gan)) for gan in GAN_KINDS}
              for arch in ARCHITECTURES}
    print(json.dumps(report, indent=2))
    return 0


def cmd_traffic(args) -> int:
    # The report reads Prometheus expositions: a service-side module, imported only here.
    from services.common.traffic import format_formulas, format_table, traffic_report

    if args.run is None:  # the formulas alone
        report = _traffic_formulas(args)
        print(json.dumps(report, indent=2) if args.json else format_formulas(report))
        return 0
    report = traffic_report(args.run)
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    return 0 if all(r["payload_matches_formula"] for r in report["rows"]) else 1


def _traffic_formulas(args) -> dict:
    from mdgan.algorithms.pwgan import PWGANOptions
    from mdgan.config import TrainingConfig
    from mdgan.data import DATASET_SAMPLE_SHAPES
    from services.common.traffic import ALGORITHMS, DATASET_TRAIN_SIZES, formula_table

    if args.shard_size is None and args.dataset not in DATASET_TRAIN_SIZES:
        raise ConfigError(f"--dataset {args.dataset}: give the worker's shard size with --shard-size")
    shard_size = args.shard_size or DATASET_TRAIN_SIZES[args.dataset] // args.workers
    config = TrainingConfig(workers=args.workers, iterations=1, batch_size=args.batch_size, disc_steps=args.disc_steps,
                            swap_epochs=args.swap_epochs, swap_every=args.swap_every,
                            swap_optimizer_state=args.swap_optimizer_state, wire_dtype=args.wire_dtype,
                            model=ModelSpec(architecture=args.architecture, gan=args.gan,
                                            sample_shape=tuple(DATASET_SAMPLE_SHAPES[args.dataset]))).validate()
    algorithms = list(ALGORITHMS) if args.algorithm == "all" else [args.algorithm]
    return formula_table(algorithms, config, shard_size, PWGANOptions(potential_rounds=args.potential_rounds).validate())


def cmd_experiment(args) -> int:
    from mdgan.experiment import run_experiment
    from mdgan.settings import configure_compute

    configure_compute(args.threads)
    previous = signal.signal(signal.SIGTERM, _raise_terminated)  # stop the runs under way too, as Ctrl-C does
    try:
        result = run_experiment(args.config, progress=not args.no_progress, only_plot=args.plot_only,
                                jobs=args.jobs, threads=args.threads)
    except Terminated as exc:
        print(f"mdgan experiment: {exc}: stopped; run it again to resume", file=sys.stderr)
        return 128 + exc.signum
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(json.dumps(result, indent=2))
    return 0


def cmd_sample(args) -> int:
    from mdgan.sampling import sample_run

    written = sample_run(args.run, args.n, args.out, seed=args.seed)
    print(f"wrote {written} samples to {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from mdgan.algorithms.options import add_algorithm_arguments
    from mdgan.attacks import ATTACKS
    from mdgan.run import ALGORITHMS
    from mdgan.settings import (EnvArgumentParser, add_data_arguments, add_evaluation_arguments, add_site_arguments,
                                add_scheduling_argument, add_threads_argument, add_training_arguments,
                                non_negative_int, positive_seconds)

    parser = EnvArgumentParser(prog="mdgan", description="MD-GAN: one generator, many discriminators, spread data.")
    sub = parser.add_subparsers(dest="command", required=True)

    def run_parser(name: str, help_text: str):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--algorithm", choices=ALGORITHMS, default="mdgan",
                       help="MD-GAN, or a baseline: FL-GAN (federated averaging of G and D every ceil(E*m/b) "
                            "iterations), a standalone GAN on the whole dataset, the parallel Wasserstein GAN "
                            "(pwgan) or the data-parallel parameter-server GAN (dpgan); see docs/ALGORITHMS.md")
        add_training_arguments(p)
        p.set_defaults(workers=None)  # 4, or the number of --site-dirs
        add_data_arguments(p)
        add_site_arguments(p, launcher=True)
        add_evaluation_arguments(p)
        add_algorithm_arguments(p)
        # One thread per process by default: the same arithmetic in every process, so the
        # in-process run and the gRPC cluster agree bit for bit.
        add_threads_argument(p, default=1)
        p.add_argument("--out", default=f"runs/{name}", help="run directory")
        p.add_argument("--no-progress", action="store_true", help="no progress bar")
        durable = p.add_argument_group("durable runs (MD-GAN)")
        durable.add_argument("--checkpoint-every", type=non_negative_int, default=0,
                             help="checkpoint every this many iterations (0: never); workers keep theirs in "
                                  "OUT/workers/")
        durable.add_argument("--keep-checkpoints", type=int, default=3, help="checkpoints kept")
        durable.add_argument("--resume", metavar="RUN", default=None,
                             help="continue the run in directory RUN from its last complete checkpoint, with the "
                                  "settings it was launched with (RUN/launch.json); an option given with --resume "
                                  "overrides one of them (a moved --data-root, say), except the training ones")
        durable.add_argument("--run-id", default=None, help="the run's id (default: a random one)")
        g = p.add_argument_group("emulated Byzantine workers (experiments)")
        g.add_argument("--byzantine", type=int, default=0,
                       help="K: the last K workers by rank send wrong feedback (needs --attack)")
        g.add_argument("--attack", choices=ATTACKS, default=None,
                       help="what they send: sign-flip (-F), scale (10 F), sign-flip-scale (-10 F), "
                            "noise (10x F's RMS), free-ride (zeros)")
        return p

    simulate = run_parser("simulate", "Train in one process: every worker is an object.")
    simulate.add_argument("--churn", default=None, metavar="EVENTS",
                          help="workers leaving and coming back, e.g. leave:300:2,join:450:2 (at the boundary after "
                               "iteration 300 the worker of slot 2 leaves; after 450 it comes back, with its saved "
                               "state or a copy of a live peer's discriminator)")
    simulate.set_defaults(func=cmd_simulate)
    local = run_parser("local", "Train on a real gRPC cluster of processes on loopback.")
    local.add_argument("--step-timeout", type=positive_seconds, default=60.0, help="deadline for a worker's feedback (s)")
    local.add_argument("--swap-timeout", type=positive_seconds, default=120.0, help="deadline for a discriminator swap (s)")
    local.add_argument("--heartbeat-interval", type=positive_seconds, default=5.0, help="idle heartbeat period (s)")
    local.add_argument("--insecure", action="store_true",
                       help="plaintext gRPC between the processes (default: mutual TLS with a throwaway CA made in "
                            "OUT/tls/)")
    local.add_argument("--join-timeout", type=positive_seconds, default=600.0,
                       help="seconds the server waits for all workers to join")
    add_scheduling_argument(local, default="batch")  # for every service of the cluster
    local.add_argument("--workers-per-process", type=int, default=0, metavar="K",
                       help="run K workers in each worker process (each still its own worker: data, gRPC client, "
                            "certificate, /metrics, log); 0 (default): one process per core the launcher may use, "
                            "i.e. ceil(workers / cores) each, and one process per worker when there are enough "
                            "cores. On a machine with fewer cores than workers this costs less CPU and starts "
                            "faster; killing one such process stops all of its workers")
    local.add_argument("--pin-workers", choices=scheduling.PIN_WORKERS_CHOICES, default="auto",
                       help="auto (default): when there are cores enough, keep each worker process on --threads "
                            "cores of its own (the server is left free): about 6%% less time per iteration on 2 "
                            "cores; nothing is pinned with more worker processes x --threads than cores, or with "
                            "--threads 0; off: let the kernel place them (e.g. when other programs keep a core "
                            "busy)")
    local.set_defaults(func=cmd_local)
    certs = sub.add_parser("certs", help="Provision a run's CA and the certificates of its server and workers.",
                           description="A CA in DIR (ca.crt, ca.key), then one key and certificate per identity "
                                       "in DIR/NAME/ (tls.crt, tls.key, ca.crt): the --tls-* files of the services.")
    certs_sub = certs.add_subparsers(dest="certs_command", required=True)
    init = certs_sub.add_parser("init", help="create the run's CA in DIR")
    init.add_argument("dir", help="directory of the run's PKI")
    issue = certs_sub.add_parser("issue", help="a key and certificate for NAME, signed by DIR's CA")
    issue.add_argument("dir", help="directory of the run's PKI (made by `mdgan certs init`)")
    issue.add_argument("name", help="the identity: a worker's name (its SAN), or the server's")
    role = issue.add_mutually_exclusive_group()
    role.add_argument("--worker", action="store_true", help="a worker's certificate (the default)")
    role.add_argument("--server", action="store_true",
                      help="the server's certificate (also valid for localhost, 127.0.0.1 and ::1)")
    issue.add_argument("--san", action="append", default=[],
                       help="another DNS name or IP address the certificate is valid for (repeatable), e.g. the "
                            "host name clients dial")
    for p in (init, issue):
        p.add_argument("--days", type=int, default=365, help="validity in days")
        p.add_argument("--overwrite", action="store_true", help="replace existing files")
    certs.set_defaults(func=cmd_certs)

    split_help = ("Cut a dataset into one folder per site (OUT/site-0, site-1, ...: an ImageFolder of PNG files, every "
                  "class folder present), to try the real path, where every worker brings its own data, on one machine.")
    split = sub.add_parser("split", help=split_help, description=split_help)
    split.add_argument("dataset", choices=("mnist", "cifar10", "synthetic"), help="the dataset to cut")
    split.add_argument("--workers", type=int, required=True, help="number of sites")
    split.add_argument("--split", choices=SPLITS, default="iid",
                       help="iid: equal random parts; dirichlet: per class, proportions over the sites ~ Dir(alpha) "
                            "(sites of different sizes and label mixes)")
    split.add_argument("--alpha", type=float, default=0.5, help="dirichlet concentration (smaller: more skewed)")
    split.add_argument("--split-seed", type=int, default=0, help="seed of the split")
    split.add_argument("--data-root", default="data", help="folder holding MNIST/raw or cifar-10-batches-py")
    split.add_argument("--samples", type=int, default=None, help="use only the dataset's first N images (quick trials)")
    split.add_argument("--out", required=True, help="folder to write site-0, site-1, ... into")
    split.set_defaults(func=cmd_split)
    sub.add_parser("models", help="Parameter counts of every architecture, as JSON.").set_defaults(func=cmd_models)
    traffic = sub.add_parser(
        "traffic", help="A run's measured traffic against its algorithm's formula, or (without RUN) the formulas.",
        description="mdgan traffic RUN: the bytes the run's processes counted, next to the per-iteration formula of "
                    "its algorithm (docs/ALGORITHMS.md); exit status 1 if they differ. Without RUN: each algorithm's "
                    "payload bytes per iteration for the settings given (the flags below; a run's come from its "
                    "summary.json).")
    traffic.add_argument("run", nargs="?", default=None, help="run directory of `mdgan local`")
    traffic.add_argument("--json", action="store_true", help="print the report as JSON")
    formulas = traffic.add_argument_group("the formulas alone (without RUN)")
    formulas.add_argument("--algorithm", choices=("all", "mdgan", "flgan", "pwgan", "dpgan"), default="all",
                          help="one algorithm, or all four side by side")
    formulas.add_argument("--workers", type=int, default=10, help="N")
    formulas.add_argument("--batch-size", type=int, default=10, help="b (pwgan: n_g = n_r = b)")
    formulas.add_argument("--disc-steps", type=int, default=1, help="L (dpgan: D rounds per iteration)")
    formulas.add_argument("--swap-epochs", type=float, default=1.0, help="E: S = ceil(E m / b) (MD-GAN swaps, "
                                                                         "FL-GAN rounds)")
    formulas.add_argument("--swap-every", type=int, default=None, help="S, instead of ceil(E m / b)")
    formulas.add_argument("--swap-optimizer-state", action="store_true",
                          help="MD-GAN: Adam moments travel with a swapped discriminator")
    formulas.add_argument("--architecture", default="mlp", help="see `mdgan models`")
    formulas.add_argument("--gan", choices=GAN_KINDS, default="acgan")
    formulas.add_argument("--dataset", choices=("mnist", "cifar10", "synthetic"), default="mnist",
                          help="sets d (and m, with --shard-size unset)")
    formulas.add_argument("--shard-size", type=int, default=None, help="m, samples per worker (default: the "
                                                                       "dataset's training set / N)")
    formulas.add_argument("--wire-dtype", choices=("float32", "float16", "bfloat16", "int8"), default="float32",
                          help="MD-GAN's compressed wire")
    formulas.add_argument("--potential-rounds", type=int, default=5, help="pwgan: T")
    traffic.set_defaults(func=cmd_traffic)
    experiment = sub.add_parser("experiment", help="Run a grid of trainings and plot the paper's figures.")
    experiment.add_argument("config", help="experiment YAML (see experiments/)")
    experiment.add_argument("--plot-only", action="store_true", help="only collect the results and plot them")
    experiment.add_argument("--no-progress", action="store_true", help="no progress bars")
    experiment.add_argument("--jobs", type=int, default=1,
                            help="runs at once, each in its own process with --threads torch threads (same results)")
    add_threads_argument(experiment, default=1)
    experiment.set_defaults(func=cmd_experiment)
    sample = sub.add_parser("sample", help="Draw samples from a run's generator (class-balanced for ACGAN).")
    sample.add_argument("run", help="run directory (holding checkpoint.pt and summary.json)")
    sample.add_argument("--n", type=int, default=100, help="number of samples")
    sample.add_argument("--out", required=True, help="FILE.npy (float32 in [-1, 1], with labels in FILE.labels.npy "
                                                    "for ACGAN) or FILE.png (a grid)")
    sample.add_argument("--seed", type=int, default=0, help="noise seed")
    sample.set_defaults(func=cmd_sample)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from mdgan import settings

    tokens = sys.argv[1:] if argv is None else list(argv)
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    after = tokens[tokens.index(args.command) + 1:] if args.command in tokens else tokens
    args.given = settings.given_options(commands[args.command], after)  # what this command chose (--resume keeps it)
    # What Ctrl-C leaves: the coroutine of a training step it cut short, never awaited. Not news.
    warnings.filterwarnings("ignore", message="coroutine .* was never awaited", category=RuntimeWarning)
    try:
        return args.func(args)
    except (ConfigError, OSError) as exc:
        # A bad value found while running (a data file, a flag combination; 2), or the system's
        # refusal (a folder that cannot be made, a full disk; 1): said under the subcommand's name,
        # without the top-level usage banner that would say nothing about it.
        print(f"{parser.prog} {args.command}: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1
    except KeyboardInterrupt:  # Ctrl-C in a command that runs in this process (`local` stops its cluster itself)
        print(f"{parser.prog} {args.command}: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
