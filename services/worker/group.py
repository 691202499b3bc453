"""Several workers in one process: what `mdgan local --workers-per-process K` runs in each of its
worker processes.

Each worker is the same as one `mdgan-worker` process: its own data, discriminator, gRPC client
and Peer server, certificate, /metrics port, state folder and log file. They share one event loop,
and with it the interpreter, torch and gRPC: on a machine with fewer cores than workers, K workers
in one process cost less CPU than K processes taking turns on a core (`bench/fifty_workers.py
--workers-per-process 1` against the default), and start once instead of K times.

What the process owns is the group's: the CPU scheduling, torch threads and allocator (those of the first
worker's flags, applied once and logged in the process's own log; the launcher gives all the
same), SIGTERM and SIGINT (they stop every worker), and its exit code (the highest of its workers'). What a worker owns stays its own: a worker that fails
ends alone, its error in its own log, and the others go on. As each worker ends, its exit code is
written to a status file (JSON, replaced atomically), from which the launcher learns which worker
failed.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import sys
from dataclasses import dataclass

from mdgan.checkpoint import atomic_write_json
from mdgan.config import ConfigError
from services.common import rpc
from services.worker.__main__ import LOG_FORMAT, build_parser, configure_process, exit_code, serve, until_signalled

# The worker whose task is running (None: the process itself, or a thread that is no worker's).
# asyncio copies the context into every task a worker's task creates, so its records follow it.
CURRENT_WORKER: contextvars.ContextVar[str | None] = contextvars.ContextVar("mdgan_worker", default=None)

log = logging.getLogger("mdgan.worker.group")


@dataclass(frozen=True)
class Member:
    name: str  # as the launcher knows it: worker-<index>
    argv: list[str]  # mdgan-worker's command line
    log_path: str


class PerWorkerLog(logging.Handler):
    """Each record to the log file of the worker that logged it; the rest to `fallback`."""

    def __init__(self, paths: dict[str, str], fallback: logging.Handler):
        super().__init__()
        self.fallback = fallback
        self.files: dict[str, logging.Handler] = {}
        for name, path in paths.items():
            handler = logging.FileHandler(path, mode="w", encoding="utf-8")
            handler.setFormatter(logging.Formatter(LOG_FORMAT))
            self.files[name] = handler

    def emit(self, record: logging.LogRecord) -> None:
        self.files.get(CURRENT_WORKER.get(), self.fallback).handle(record)

    def close(self) -> None:
        for handler in self.files.values():
            handler.close()
        super().close()


async def _serve_member(args) -> int:
    """One worker, to its exit code; its ending reason in its own log."""
    try:
        reason = await serve(args)
    except (Exception, asyncio.CancelledError) as exc:  # one worker's ending is not its siblings'
        code = exit_code(exc)
        if code is None:  # not one of the known endings: a bug, logged whole in this worker's log
            log.error("worker failed", exc_info=exc)
            return 1
        return code
    logging.getLogger("mdgan.worker").info("finished: %s", reason)
    return 0


async def serve_group(members: list[tuple[Member, object]], status_path: str) -> dict[str, int]:
    """Every worker as a task of its own, its name set in the task's context (for PerWorkerLog);
    {worker: exit code} kept in `status_path` ({worker: None} while it runs)."""
    codes: dict[str, int | None] = {member.name: None for member, _ in members}
    atomic_write_json(status_path, codes)

    async def run(member: Member, args) -> int:
        codes[member.name] = await _serve_member(args)
        atomic_write_json(status_path, codes)
        return codes[member.name]

    loop, tasks = asyncio.get_running_loop(), []
    for member, args in members:
        context = contextvars.copy_context()
        context.run(CURRENT_WORKER.set, member.name)
        tasks.append(loop.create_task(run(member, args), context=context))
    outcomes = await until_signalled(*tasks)
    for (member, _), outcome in zip(members, outcomes):
        if isinstance(outcome, BaseException):  # cancelled before its task had started
            codes[member.name] = 0 if isinstance(outcome, asyncio.CancelledError) else 1
    atomic_write_json(status_path, codes)
    return codes


def main(members: list[Member], status_path: str) -> int:
    parsed = [(member, build_parser().parse_args(member.argv)) for member in members]
    first = parsed[0][1]
    root = logging.getLogger()
    root.setLevel(first.log_level)
    fallback = logging.StreamHandler(sys.stderr)  # the group's own log: its process's output
    fallback.setFormatter(logging.Formatter(LOG_FORMAT))
    router = PerWorkerLog({member.name: member.log_path for member in members}, fallback)
    root.addHandler(router)
    log.info("%d workers in this process: %s", len(members), ", ".join(m.name for m in members))
    try:
        configure_process(first)  # the process's; the launcher gives every worker the same flags
        codes = rpc.run(serve_group(parsed, status_path))
        log.info("exit codes: %s", codes)
    except ConfigError as exc:  # before any worker started: the process's own error, in its log
        log.error("%s", exc.for_flags())
        return 2
    finally:
        root.removeHandler(router)
        router.close()
    return max(codes.values(), default=0)

