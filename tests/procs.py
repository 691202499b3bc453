"""Start the real services as processes on loopback, for end-to-end tests."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

from conftest import REPO


class Proc:
    """A process whose output goes to a log file, for tests that start real programs."""

    def __init__(self, name: str, argv: list[str], log_path: str, env: dict | None = None, cwd: str = REPO):
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.popen = subprocess.Popen(argv, cwd=cwd, stdout=self._log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, env=env)

    def wait(self, timeout: float) -> int:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} still running after {timeout} s; log:\n{self.log()}") from None

    def wait_for_log(self, text: str, timeout: float) -> str:
        """Block until the log holds `text`; fails (with the log) if the process exits first or `timeout`
        passes. Returns the log."""
        deadline = time.monotonic() + timeout
        while text not in (log := self.log()):
            assert self.popen.poll() is None, f"{self.name} exited before logging {text!r}:\n{log}"
            assert time.monotonic() < deadline, f"{self.name} did not log {text!r} within {timeout} s:\n{log}"
            time.sleep(0.1)
        return log

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        with open(self.log_path) as fh:
            return fh.read()[-4000:]

    def stop(self, grace: float = 10) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds."""
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()
        self._log.close()


@dataclass
class Completed:
    """What a command left: its exit status and what it printed (subprocess.CompletedProcess's names)."""
    returncode: int
    stdout: str
    stderr: str


def mdgan_in_process(*argv: str, check: bool = True) -> Completed:
    """`mdgan ARGV` run by its own main() in this test process: the command's parser and code, without
    a new interpreter's seconds of imports. For commands that train or read in this process (simulate,
    traffic, split, certs, score, experiment); `mdgan local` and the services run as processes. torch's
    thread count is put back afterwards (`--threads` sets it for the process)."""
    import torch

    from mdgan_app.cli import main

    threads = torch.get_num_threads()
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main([str(a) for a in argv])
            except SystemExit as exit:  # argparse's refusals
                code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
    finally:
        torch.set_num_threads(threads)
    done = Completed(code, out.getvalue(), err.getvalue())
    if check:
        assert code == 0, f"mdgan {' '.join(map(str, argv))} exited {code}:\n{done.stdout}{done.stderr}"
    return done


def mdgan(*argv: str, check: bool = True, env: dict | None = None, timeout: float = 300):
    """`mdgan ARGV` as the tests run it: `mdgan local` as the command it is (its services are processes),
    every other command in this process (mdgan_in_process). Its exit status, stdout and stderr."""
    if argv[0] != "local":
        assert env is None, "an environment is for a process"
        return mdgan_in_process(*argv, check=check)
    done = subprocess.run([sys.executable, "-m", "mdgan_app.cli", *map(str, argv)], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env=env)
    if check:
        assert done.returncode == 0, done.stdout + done.stderr
    return done


def python_module(name: str, argv: list[str], log_dir: str, env: dict | None = None) -> Proc:
    """`python -m argv...` from the repository, logging to LOG_DIR/NAME.log (env: this one's by default)."""
    return Proc(name, [sys.executable, "-m", *argv], os.path.join(log_dir, f"{name}.log"), env=env or dict(os.environ))


def _security(flags) -> list[str]:
    """Plaintext unless the test passes its own --tls-* flags (the services refuse to guess)."""
    return [] if "--tls-ca" in flags or "--insecure" in flags else ["--insecure"]


def tls_flags(pki_dir: str, name: str) -> list[str]:
    """--tls-* flags for identity `name` of a PKI made with services.common.pki."""
    folder = os.path.join(pki_dir, name)
    return ["--tls-ca", os.path.join(folder, "ca.crt"), "--tls-cert", os.path.join(folder, "tls.crt"),
            "--tls-key", os.path.join(folder, "tls.key")]


def start_server(out: str, *flags: str, name: str = "server", env: dict | None = None) -> tuple[Proc, int]:
    port_file = os.path.join(out, "server.port")
    os.makedirs(out, exist_ok=True)
    server = python_module(name, ["services.server", "--listen", "127.0.0.1:0", "--port-file", port_file, "--out", out,
                         "--threads", "1", "--metrics-port", "0", *_security(flags), *flags], out, env)
    deadline = time.monotonic() + 60
    while not os.path.exists(port_file):
        if server.popen.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"server did not start:\n{server.log()}")
        time.sleep(0.05)
    with open(port_file) as fh:
        return server, int(fh.read())


def start_worker(out: str, port: int, index: int | str, num_shards: int, *flags: str, name: str | None = None,
                 env: dict | None = None) -> Proc:
    return python_module(name or f"worker-{index}", ["services.worker", "--server", f"127.0.0.1:{port}", "--listen", "127.0.0.1:0",
                                    "--advertise-address", "127.0.0.1", "--shard-index", str(index),
                                    "--num-shards", str(num_shards), "--threads", "1", "--metrics-port", "0",
                                    *_security(flags), *flags], out, env)


def kit_environment(kit: str, data: str | None, state: str | None, out: str | None) -> dict[str, str]:
    """A kit's mdgan.env (`mdgan certs kit`) as its service reads it, the container paths mapped onto this machine's
    folders (what compose's volumes do)."""
    env = dict(os.environ)
    mounts = {"/tls/": os.path.join(kit, "tls") + "/", "/data": data, "/state": state, "/runs/mdgan": out}
    with open(os.path.join(kit, "mdgan.env")) as fh:
        for line in fh:
            key, _, value = line.strip().partition("=")
            for inside, outside in mounts.items():
                if outside and value.startswith(inside):
                    value = outside + value[len(inside):]
            env[key] = value
    return env


def read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        text = fh.read()
    # a file being written may end in half a line: only complete lines count
    return [json.loads(line) for line in text.split("\n")[:-1] if line.strip()]


def drop_checkpoints(store, iterations) -> None:
    """Empty these checkpoints' folders of `store` (a CheckpointStore): as if the process died before
    writing them."""
    for iteration in iterations:
        for name in os.listdir(store.folder(iteration)):
            os.remove(os.path.join(store.folder(iteration), name))


def read_json(path: str) -> dict:
    with open(path) as fh:
        return json.load(fh)


def wait_for_iterations(server: Proc, out: str | os.PathLike, count: int, timeout: float = 120.0) -> list[dict]:
    """Block until the server's history.jsonl holds `count` iterations; fails (with the server's log)
    if the server exits first or `timeout` passes. Returns the records read."""
    history = os.path.join(out, "history.jsonl")
    deadline = time.monotonic() + timeout
    while len(records := read_jsonl(history)) < count:
        assert time.monotonic() < deadline, f"{len(records)} of {count} iterations in {timeout:.0f} s\n{server.log()}"
        assert server.popen.poll() is None, server.log()
        time.sleep(0.05)
    return records


def session_processes(session: int) -> list[int]:
    """The live processes of a session (a command started with start_new_session: its pid)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == session and fields[0] != "Z":  # fields[3]: the session id
                found.append(int(entry))
    return found
