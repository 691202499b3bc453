"""A worker's own errors: the first one is logged with its traceback, told to the server as a Fault (a
status code and one line, never the traceback), and ends the worker with WorkerFailed (exit 1)."""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

import grpc

from services.common import rpc
from services.common.proto import coordinator_pb2 as pb
from services.worker.algorithms.base import WorkerFailed

log = logging.getLogger("mdgan.worker")

FAULT_REPORT_S = 5.0  # how long a failed worker tries to tell the server before it exits


class FaultReport:
    """This worker's fault, once it has one, and its report on the session's stream."""

    def __init__(self, name: Callable[[], str], write: Callable[[object, pb.WorkerMessage], Awaitable[None]]):
        self.name = name  # who this worker is, for the log and the error ("worker-2")
        self.write = write  # (call, message): a write on the session's stream
        self.fault: pb.Fault | None = None
        self._sent = False
        self._ending: asyncio.Task | None = None  # a fault found in another task, being reported

    def record(self, where: str, exc: BaseException, trained_iteration: int, session: asyncio.Task | None,
               call: Callable[[], object]) -> WorkerFailed:
        """The first fault: logged with its traceback and kept. From a task other than the session's
        (`session`), its report is written on the stream (`call()`) now; the server then ends the
        stream, and with it the session (cancelled only if that does not come)."""
        if self.fault is None:
            cause = rpc.one_line(exc)
            log.error("%s failed while %s: %s", self.name(), where, cause, exc_info=exc)
            self.fault = pb.Fault(code=rpc.INTERNAL, message=cause, where=where, iteration=trained_iteration)
            if session is not None and session is not asyncio.current_task() and not session.done():
                self._ending = asyncio.get_running_loop().create_task(self._end_session(session, call))
        return self.error()

    def error(self) -> WorkerFailed:
        return WorkerFailed(f"{self.name()} failed while {self.fault.where}: {self.fault.message}")

    async def send(self, call) -> None:
        """The Fault and the end of our writing, once (best effort, within FAULT_REPORT_S)."""
        if self._sent or call is None:
            return
        self._sent = True
        try:
            async with asyncio.timeout(FAULT_REPORT_S):
                await self.write(call, pb.WorkerMessage(fault=self.fault))
                await call.done_writing()
        except Exception as exc:  # (gone, a deadline, a broken stream): the worker exits all the same
            log.debug("the fault was not sent: %r", exc)

    async def report(self, call) -> None:
        """From the session's own task (the stream's reader): the Fault, then wait for the server to end
        the stream (its acknowledgement), within FAULT_REPORT_S."""
        await self.send(call)
        try:
            async with asyncio.timeout(FAULT_REPORT_S):
                while await call.read() is not grpc.aio.EOF:
                    pass
        except Exception as exc:
            log.debug("the fault was not acknowledged: %r", exc)

    async def _end_session(self, session: asyncio.Task, call: Callable[[], object]) -> None:
        """A fault found outside the session's task: report it on the stream, give the session the time
        the server takes to end the stream, then end the task."""
        current = call()
        if current is not None:  # (between sessions there is nobody to tell)
            await self.send(current)
            await asyncio.wait([session], timeout=2 * FAULT_REPORT_S)
        if not session.done():
            session.cancel()  # (no stream, or no answer: nothing is left to cut short)
