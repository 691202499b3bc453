"""One admitted worker's stream, whatever the algorithm: what every algorithm's handle stands on.

The split follows Flower's ClientProxy over a transport: a `WorkerConnection` owns the stream
(sending under a write lock with telemetry, the read loop with its liveness deadline, malformed
input, heartbeats, losing the worker, the answers still awaited), and a `StreamHandle` subclass
per algorithm (services/server/algorithms/) is what that algorithm's training loop holds: it
sends its own orders through the connection and receives only its own messages from it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, ClassVar

import grpc

from mdgan.algorithms.base import RUN_FINISHED, WorkerLost
from services.common.proto import coordinator_pb2 as pb
from services.common.rpc import MalformedMessage, bounded
from services.common.telemetry import Telemetry
from services.common.wire import CONTROL

log = logging.getLogger("mdgan.server")

INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]  # 3, the google.rpc.Code value


def clean_line(text: str) -> str:
    """A worker's text as one printable line, bounded (it reaches the server's logs and its exit line)."""
    return bounded(" ".join("".join(c if c.isprintable() else " " for c in text).split()))


class StreamHandle:
    """An algorithm's handle on one worker's stream: what its training loop calls (step, local_round,
    ...), over `connection`. A subclass (one per algorithm) names the message bodies it receives in
    `receivers()`, and the telemetry kind and payload of its messages in `traffic()`; any other body
    from the worker is refused with a rejection ("protocol")."""

    algorithm: ClassVar[str] = ""
    # Set: joins after the run started are refused with this reason (FAILED_PRECONDITION).
    late_join_refusal: ClassVar[str | None] = None
    # the workers dial each other (MD-GAN's swaps): the server dials a joiner's Peer address first
    peer_to_peer: ClassVar[bool] = False

    def __init__(self, connection: WorkerConnection):
        self.connection = connection
        self.worker_id = connection.worker_id
        self.identity = connection.identity
        self.shard_index = connection.shard_index
        self.shard_size = connection.shard_size
        connection.attach(self)

    @classmethod
    def run_state(cls, coordinator) -> object:
        """What the run's handles of this algorithm share (built once, by the Coordinator)."""
        return None

    def receivers(self) -> dict[str, Callable[[object], Awaitable[None]]]:
        """Body name (of WorkerMessage's oneof) -> coroutine taking that body."""
        return {}

    @staticmethod
    def traffic(body: str | None, message) -> tuple[str, int]:
        """(telemetry kind, payload bytes) of a message this algorithm sends or receives."""
        return CONTROL

    async def stop(self, reason: str) -> None:
        await self.connection.stop(reason)


class WorkerConnection:
    """The server's end of one admitted worker's Train stream."""

    def __init__(self, shard_index: int, shard_size: int, join: pb.Join, context: grpc.aio.ServicerContext,
                 telemetry: Telemetry, liveness_timeout: float, identity: str = "",
                 on_fault: Callable[[str], None] | None = None, relayed_certificate: bytes | None = None):
        self.worker_id = f"worker-{shard_index}"
        self.identity = identity or self.worker_id  # who holds the shard (certificate name under mTLS)
        self.shard_index = shard_index
        self.shard_size = shard_size
        self.peer_address = join.peer_address
        self.relayed_certificate = relayed_certificate  # its swaps come through the relay, sealed for this (PEM)
        # an emulated worker's split of the shared dataset (DataConfig's fields but data_root); None: a site
        self.split = ({f.name: getattr(join.split, f.name) for f in join.split.DESCRIPTOR.fields}
                      if join.HasField("split") else None)
        self.context = context
        self.telemetry = telemetry
        self.liveness_timeout = liveness_timeout
        self.malformed: str | None = None  # the stream carried bytes that do not parse
        self.closed = asyncio.Event()
        self.lost_reason: str | None = None
        self.fault: str | None = None  # the worker failed: "failed while ...: its cause" (from its Fault)
        self.on_fault = on_fault  # told that cause (the roster: a failed worker does not come back by itself)
        self.last_write = time.monotonic()
        self._write_lock = asyncio.Lock()
        self._answers: dict[str, dict] = {}  # name -> key -> Future: the answers the handle awaits
        self.handle: StreamHandle | None = None
        self._receivers: dict[str, Callable[[object], Awaitable[None]]] = {}
        self._traffic: Callable[[str | None, object], tuple[str, int]] = StreamHandle.traffic

    def attach(self, handle: StreamHandle) -> None:
        self.handle = handle
        self._receivers = handle.receivers()
        self._traffic = handle.traffic

    def answers(self, name: str) -> dict:
        """A registry of pending answers (key -> Future) that lose() fails with WorkerLost."""
        return self._answers.setdefault(name, {})

    # -- sending -----------------------------------------------------------------------------
    async def request(self, answers: dict, key, messages):
        """Send `messages` (one ServerMessage or several, in order) and wait for the answer that a
        receiver puts in answers[key] (a registry from answers(name)); the entry is removed however
        the request ends. Raises WorkerLost when the stream is lost meanwhile (lose() fails it)."""
        answer = await self.post(answers, key, messages)
        try:
            return await answer
        finally:
            answers.pop(key, None)

    async def post(self, answers: dict, key, messages) -> asyncio.Future:
        """Send `messages` now; the answer a receiver puts in answers[key], to come (the entry is removed
        once it is in, or failed: lose() fails it with WorkerLost). Raises WorkerLost if a send fails."""
        answer = asyncio.get_running_loop().create_future()
        answers[key] = answer

        def settled(done) -> None:
            if answers.get(key) is done:
                answers.pop(key)
            self._arm_liveness()

        answer.add_done_callback(settled)
        self._arm_liveness()
        try:
            for message in (messages,) if isinstance(messages, pb.ServerMessage) else messages:
                await self.send(message)
        except BaseException:
            answers.pop(key, None)
            answer.cancel()
            raise
        return answer

    async def send(self, message: pb.ServerMessage) -> None:
        if self.closed.is_set():
            raise WorkerLost(f"{self.worker_id}: stream closed ({self.lost_reason or 'stopped'})")
        try:
            async with self._write_lock:
                await self.context.write(message)
                self.last_write = time.monotonic()
        except Exception as exc:  # the stream broke under us: the worker is gone
            self.lose(f"write failed: {exc!r}")
            raise WorkerLost(f"{self.worker_id}: {exc!r}") from exc
        kind, payload = self._traffic(message.WhichOneof("body"), message)
        self.telemetry.count("server_to_worker", kind, "sender", message, payload)

    async def reject(self, iteration: int, reason: str, detail: str) -> None:
        """Tell the worker its input was refused (the stream goes on)."""
        log.warning("%s: rejected input at iteration %d: %s", self.worker_id, iteration, detail)
        self.telemetry.rejected.labels(reason).inc()
        try:
            await self.send(pb.ServerMessage(rejection=pb.Rejection(
                iteration=iteration, code=INVALID_ARGUMENT, reason=reason, message=detail)))
        except WorkerLost:
            pass

    async def stop(self, reason: str) -> None:
        if self.closed.is_set():
            return
        if reason != RUN_FINISHED:
            self.telemetry.departures.labels("dropped").inc()
        try:
            await self.send(pb.ServerMessage(stop=pb.Stop(reason=reason)))
        finally:
            self.closed.set()

    def lose(self, reason: str) -> None:
        """The stream is gone: every pending answer fails with WorkerLost."""
        if self.lost_reason is None and not self.closed.is_set():
            self.lost_reason = reason
            self.telemetry.departures.labels("disconnected").inc()
            log.warning("%s lost: %s", self.worker_id, reason)
        self.end(reason)

    def fail(self, fault: pb.Fault) -> None:
        """The worker reports its own error, its last message: logged naming it, and it is lost (every pending
        answer fails with WorkerLost saying why)."""
        where = clean_line(fault.where) or "working"
        self.fault = f"failed while {where}: {clean_line(fault.message) or 'no cause given'}"
        if self.lost_reason is None and not self.closed.is_set():
            self.lost_reason = self.fault
            self.telemetry.departures.labels("failed").inc()
            log.error("%s%s %s", self.worker_id, f" ({self.identity})" if self.identity != self.worker_id else "",
                      self.fault)
            if self.on_fault is not None:
                self.on_fault(self.fault)
        self.end(self.fault)

    def end(self, reason: str) -> None:
        """End the stream from our side (no departure counted): every pending answer fails with
        WorkerLost and the call returns."""
        for pending in self._answers.values():
            for future in pending.values():
                if not future.done():
                    future.set_exception(WorkerLost(f"{self.worker_id}: {reason}"))
        self.closed.set()

    async def heartbeats(self, interval: float) -> None:
        # Only when idle: a busy stream already tells the worker the server is alive.
        while not self.closed.is_set():
            await asyncio.sleep(interval)
            if time.monotonic() - self.last_write >= interval:
                try:
                    await self.send(pb.ServerMessage(heartbeat=pb.Heartbeat(unix_ms=int(time.time() * 1000))))
                except WorkerLost:
                    return

    # -- receiving ---------------------------------------------------------------------------
    def owes(self) -> bool:
        """Whether the worker owes an answer (a step, a swap, a checkpoint, a round) to a request of ours."""
        return any(not f.done() for pending in self._answers.values() for f in pending.values())

    def _arm_liveness(self) -> None:
        """Silence counts against the liveness deadline only while the worker owes nothing: a worker busy with a
        long step cannot say anything until it answers, which the request's own deadline bounds (--step-timeout,
        --swap-timeout), and a connection that died under it is noticed by the transport's keepalive pings."""
        deadline = self._liveness  # (None between two reads)
        if deadline is not None:
            try:
                deadline.reschedule(None if self.owes() else asyncio.get_running_loop().time() + self.liveness_timeout)
            except RuntimeError:  # it has just expired: the read loop is ending the stream
                pass

    _liveness: asyncio.Timeout | None = None

    async def read_loop(self) -> None:
        while not self.closed.is_set():
            try:
                try:
                    async with asyncio.timeout(None) as self._liveness:  # (wait_for would make a task per read)
                        self._arm_liveness()
                        message = await self.context.read()
                finally:
                    self._liveness = None
            except asyncio.TimeoutError:
                self.lose(f"silent for {self.liveness_timeout:.0f} s while it owed nothing")
                return
            except MalformedMessage as exc:  # garbage on an admitted stream: end it with INVALID_ARGUMENT
                self.telemetry.rejected.labels("malformed").inc()
                self.malformed = str(exc)
                self.lose(f"sent a message that does not parse: {exc}")
                return
            except Exception as exc:
                self.lose(f"read failed: {exc!r}")
                return
            if message is grpc.aio.EOF:
                self.lose("stream closed by the worker")
                return
            body = message.WhichOneof("body")
            kind, payload = self._traffic(body, message)
            self.telemetry.count("worker_to_server", kind, "receiver", message, payload)
            if body == "fault":
                self.fail(message.fault)
                return
            receive = self._receivers.get(body)
            if receive is not None:
                await receive(getattr(message, body))
            elif body != "heartbeat":
                await self.reject(0, "protocol", f"unexpected {body!r} message after join")
