"""A worker's sessions with its server: connect, join, welcome, heartbeats, serve the server's
messages, reconnect with backoff after a broken stream, stop. The worker itself (what it trains on,
what it keeps, its identity, the run's algorithm) is services/worker/node.py's WorkerNode."""

from __future__ import annotations

import asyncio
import logging
import random
import time

import grpc

from mdgan.algorithms.base import RUN_FAILED, RUN_FINISHED
from services.common import rpc, tls as tls_
from services.common.proto import coordinator_pb2 as pb
from services.common.proto import coordinator_pb2_grpc
from services.worker.algorithms.base import BudgetSpent, RunFailed, ServerGone, StreamBroken, WorkerFailed

log = logging.getLogger("mdgan.worker")


class JoinRefused(Exception):
    """The server refused this worker for good (another run, another identity, a bad join)."""


class DroppedByServer(StreamBroken):
    """The server stopped this worker before the run's end: it missed a deadline, or its swap or
    checkpoint failed. Each is passing, and the run is elastic: the worker rejoins as after a broken
    stream, keeping its discriminator."""


class RunEnded(Exception):
    """The server says the run this worker holds has ended: it was away at the end and never told."""

    def __init__(self, run_id: str):
        super().__init__(run_id)
        self.run_id = run_id


# How a session ends on purpose; any other exception in the worker's own code is a fault (WorkerNode.fail).
ENDINGS = (ServerGone, BudgetSpent, JoinRefused, RunEnded, RunFailed, WorkerFailed)


# Join refusals that retrying cannot change; anything else (UNAVAILABLE while the server restarts,
# ALREADY_EXISTS while it has not yet noticed our previous stream died, ...) is retried.
FINAL_REFUSALS = {grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.PERMISSION_DENIED,
                  grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED,
                  grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNIMPLEMENTED}


CONNECT_TRY_S = 5.0  # how long one connection attempt may take


def backoff_delays(base: float = 0.5, cap: float = 10.0):
    """Exponential backoff with jitter: 0.5, 1, 2, ... capped at 10 s, each scaled by U(0.5, 1) so
    workers that lost the same server do not all knock again at the same instant."""
    attempt = 0
    while True:
        yield min(cap, base * 2 ** attempt) * random.uniform(0.5, 1.0)
        attempt += 1


async def _why_unreachable(channel: grpc.aio.Channel) -> str:
    """': REASON' when a failed connection's cause means something to an operator (a TLS handshake that
    failed: another PKI's certificate, a clock, a name); '' for a server that is simply not there."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from services.common import pki

    try:
        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2.0)
    except grpc.aio.AioRpcError as exc:
        meaning = pki.explain_handshake(exc.details() or "")
        return f": {meaning}" if meaning else ""
    return ""


class ServerSessions:
    """Runs a WorkerNode's sessions with its server until the run ends for it."""

    def __init__(self, node):
        self.node = node

    async def run(self) -> str:
        """Join, train until told to stop; returns the stop reason. A broken stream is not the end:
        the worker reconnects (backoff with jitter) and rejoins the same run, until it has heard
        nothing from a server of its run for --server-timeout seconds."""
        deadline = time.monotonic() + self.node.connect_timeout  # the first contact
        delays = backoff_delays()
        self.node.task = asyncio.current_task()
        try:
            return await self._run(deadline, delays)
        except asyncio.CancelledError:
            if self.node.fault is None:  # a signal
                raise
            self.node.task.uncancel()
            raise self.node.faults.error() from None
        finally:
            self.node.task = None

    async def _run(self, deadline: float, delays) -> str:
        while True:
            try:
                return await self._session(deadline)
            except JoinRefused:
                raise
            except BudgetSpent as spent:  # (the stream closes with the session: the server sees us leave)
                log.warning("leaving the run: %s", spent)
                return f"privacy budget: {spent}"
            except RunEnded as ended:
                if self.node.run_state.pinned_run:  # this worker joins that run only: its end is ours
                    log.info("run %s ended while we were away (the server says so): done", ended.run_id)
                    self.node.run_state.forget()
                    return RUN_FINISHED
                log.warning("run %s ended while we were away (the server says so): forgetting it and joining "
                            "the server's run as a newcomer", ended.run_id)
                self.node.run_state.leave()  # join the server's run as a newcomer, with a new discriminator
                self.node.algorithm, self.node.worker_id = None, ""
                continue
            except (StreamBroken, grpc.aio.AioRpcError) as exc:
                if self.node.fault is not None:  # the server ended the stream after our Fault
                    raise self.node.faults.error() from None
                if isinstance(exc, grpc.aio.AioRpcError) and exc.code() in FINAL_REFUSALS:
                    raise JoinRefused(f"{exc.code().name}: {exc.details()}") from None
                why = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                dropped = isinstance(exc, DroppedByServer)
                if not self.node.reconnect:
                    raise ServerGone(why) from None
                if self._contact is not None:  # we were in: from now on the server timeout bounds the wait
                    deadline = self._contact + self.node.server_timeout
                    self._contact = None
                    delays = backoff_delays()
                    self.node.telemetry.departures.labels("dropped" if dropped else "reconnect").inc()
                delay = next(delays)
                if time.monotonic() + delay >= deadline:
                    raise ServerGone(f"no server of our run came back in time (last: {why})") from None
                log.warning("%s (%s); reconnecting in %.1f s",
                            "the server dropped us before the run's end" if dropped else "lost the server", why, delay)
                await asyncio.sleep(delay)

    _contact: float | None = None  # monotonic time of the last message from the server, while joined

    async def _session(self, deadline: float) -> str:
        """One connection: join, train until stopped or the stream breaks."""
        async with tls_.channel(self.node.server_address, self.node.tls, rpc.options(), self.node.server_name) as channel:
            remaining = deadline - time.monotonic()
            try:  # a short try, then our own backoff: gRPC's would wait up to two minutes between tries
                await asyncio.wait_for(channel.channel_ready(), max(0.1, min(remaining, CONNECT_TRY_S)))
            except asyncio.TimeoutError:
                why = await _why_unreachable(channel)
                if remaining <= CONNECT_TRY_S:
                    raise ServerGone(f"could not reach the server at {self.node.server_address} in time{why}") from None
                raise StreamBroken(f"the server at {self.node.server_address} is not reachable{why}") from None
            call = coordinator_pb2_grpc.CoordinatorStub(channel).Train(timeout=self.node.run_deadline)
            await self.node.write(call, self.node.join_message())
            try:
                welcome = await self.node.read(call)
            except (StreamBroken, grpc.aio.AioRpcError):  # a refusal: an error status, with its trailing metadata
                code = await call.code()
                ended = (await call.trailing_metadata() or {}).get(rpc.FINISHED_RUN_KEY)
                if code == grpc.StatusCode.FAILED_PRECONDITION and ended and ended == self.node.run_state.run_id:
                    raise RunEnded(ended) from None
                if code in FINAL_REFUSALS:
                    raise JoinRefused(f"{code.name}: {await call.details()}") from None  # (exit_code says who)
                raise
            if welcome.WhichOneof("body") != "welcome":
                raise ServerGone(f"expected a welcome, got {welcome.WhichOneof('body')}")
            beats = relay = None
            self.node.call = call
            self.node.server_channel = channel
            try:
                try:
                    await self.node.on_welcome(welcome.welcome)
                except ENDINGS:
                    raise
                except Exception as exc:  # our own error setting up the run (a model on a device, a state)
                    raise self.node.fail("setting up the run", exc) from None
                self._contact = time.monotonic()
                beats = asyncio.create_task(self._heartbeats(call, welcome.welcome.heartbeat_interval_ms / 1000))
                if welcome.welcome.relayed:
                    relay = asyncio.create_task(self._attach_to_relay(channel, welcome.welcome.relay_reason))
                return await self._serve(call)
            except asyncio.CancelledError:
                if self.node.fault is None:  # a signal
                    raise
                asyncio.current_task().uncancel()  # a fault elsewhere, whose report got no answer
                raise self.node.faults.error() from None
            except WorkerFailed:
                await self.node.faults.report(call)
                raise
            finally:
                self.node.call = None
                self.node.server_channel = None
                for task in (beats, relay):
                    if task is not None:
                        task.cancel()
                if self.node.algorithm is not None:
                    await self.node.algorithm.end_session()

    async def _attach_to_relay(self, channel: grpc.aio.Channel, reason: str) -> None:
        """This session's attachment to the server's relay, attached again (with backoff) if it breaks."""
        from services.worker.relay import RelayInbox

        log.info("swaps through the server's relay: %s", reason)
        delays = backoff_delays()
        while True:
            inbox = RelayInbox(self.node.peer_servicer, self.node.tls, self.node.identity, self.node.swap_timeout)
            try:
                await inbox.run(channel)
            except grpc.aio.AioRpcError as exc:
                delay = next(delays)
                log.warning("the relay stream ended (%s: %s); attaching again in %.1f s", exc.code().name,
                            exc.details(), delay)
                await asyncio.sleep(delay)

    async def _serve(self, call) -> str:
        receivers = self.node.algorithm.receivers()
        while True:
            message = await self.node.read(call)
            self._contact = time.monotonic()
            body = message.WhichOneof("body")
            receive = receivers.get(body)
            if receive is not None:
                try:
                    await receive(call, getattr(message, body))
                except BudgetSpent as spent:  # told to the server, which names it where the run ends
                    await self._say_budget_spent(call, f"answering {body}", spent)
                    raise
                except (*ENDINGS, grpc.aio.AioRpcError):
                    raise
                except Exception as exc:  # our own error answering the server
                    raise self.node.fail(f"answering {body}", exc) from None
            elif body == "heartbeat":
                continue
            elif body == "rejection":
                r = message.rejection
                log.error("the server rejected our input at iteration %d: %s (%s)", r.iteration, r.message, r.reason)
            elif body == "stop":
                await call.done_writing()
                if message.stop.failed:
                    raise RunFailed(f"{RUN_FAILED}: {message.stop.reason}")
                if message.stop.reason != RUN_FINISHED:
                    raise DroppedByServer(message.stop.reason)
                log.info("stopped by the server: %s", message.stop.reason)
                if self.node.algorithm is not None:
                    self.node.run_state.keep_final_discriminator(self.node.algorithm.final_discriminator(), self.node.worker_id,
                                                            self.node.algorithm.name)
                self.node.run_state.forget()
                return message.stop.reason
            else:  # another algorithm's message, or one that has no place after the welcome
                raise ServerGone(f"the server sent a {body!r} message, which a {self.node.algorithm.name} worker does "
                                 "not take")

    async def _say_budget_spent(self, call, where: str, spent: BudgetSpent) -> None:
        """This site leaves at its privacy budget: a Fault (RESOURCE_EXHAUSTED) tells the server why, so that it
        does not wait for the site to come back (best effort: the site leaves all the same)."""
        trained = self.node.algorithm.trained_iteration if self.node.algorithm is not None else 0
        try:
            async with asyncio.timeout(5):
                await self.node.write(call, pb.WorkerMessage(fault=pb.Fault(
                    code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], message=rpc.bounded(str(spent)), where=where,
                    iteration=trained)))
                await call.done_writing()
        except Exception as exc:  # (the stream is gone)
            log.debug("the end of our budget was not told: %r", exc)

    async def _heartbeats(self, call, interval: float) -> None:
        while True:
            await asyncio.sleep(interval or 5.0)
            try:
                await self.node.write(call, pb.WorkerMessage(heartbeat=pb.Heartbeat(unix_ms=int(time.time() * 1000))))
            except Exception:  # the stream is closing; the main loop reports why
                return
