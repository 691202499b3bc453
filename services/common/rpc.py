"""gRPC plumbing shared by both services: limits, keepalive, health, reflection, hostile input."""

from __future__ import annotations

import asyncio
import inspect
import logging
import time

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

log = logging.getLogger("mdgan.rpc")

# Clients that trust the other end (a worker dialling its authenticated server) keep a generous
# bound; servers size what they accept to the model (see message_bytes_for).
MAX_MESSAGE_BYTES = 64 << 20
MESSAGE_HEADROOM = 256 << 10  # framing, headers and control fields around the tensors
# Trailing metadata of a join refused because the worker's run has ended (its id): the worker forgets
# that run and joins the server's (it was away when the run ended and was never told).
FINISHED_RUN_KEY = "mdgan-finished-run"
MAX_CONCURRENT_STREAMS = 16  # per HTTP/2 connection: one Train stream, health checks, a few pushes


def options(max_message_bytes: int = MAX_MESSAGE_BYTES, *, max_send_bytes: int | None = None,
            max_concurrent_streams: int | None = None) -> list[tuple[str, int]]:
    opts = [
        ("grpc.max_send_message_length", max_send_bytes or max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # Keepalive pings notice a peer that vanished without closing its connection (a NAT or proxy that dropped
        # it without a word) within 15 s, and keep an idle connection's NAT mapping alive (their idle timeouts
        # are 30 s and more). A server takes pings as often as every 5 s (min_ping_interval_without_data below).
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ]
    if max_concurrent_streams:
        opts.append(("grpc.max_concurrent_streams", max_concurrent_streams))
    return opts


MAX_CAUSE_CHARS = 300  # a fault's cause on the wire: one line, bounded
INTERNAL = grpc.StatusCode.INTERNAL.value[0]  # 13, the google.rpc.Code of an exception of our own


def one_line(exc: BaseException) -> str:
    """An exception as one line for a status or a log: its type and the first line of its text (never
    a traceback), at most MAX_CAUSE_CHARS characters."""
    text = str(exc).strip().splitlines()
    return bounded(f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__)


def bounded(line: str) -> str:
    """A line cut to MAX_CAUSE_CHARS characters (an ellipsis says it was)."""
    return line if len(line) <= MAX_CAUSE_CHARS else line[:MAX_CAUSE_CHARS - 3] + "..."


def message_bytes_for(*tensor_bytes: int) -> int:
    """A message bound from the largest tensor payload a message may carry, plus headroom."""
    return max(tensor_bytes, default=0) + MESSAGE_HEADROOM


class RateLimitedWarnings:
    """One warning line per kind of bad input per `period` seconds, with a count of the ones held back,
    so a flood of garbage cannot flood the logs."""

    def __init__(self, logger: logging.Logger, period: float = 10.0):
        self.logger = logger
        self.period = period
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def warn(self, kind: str, message: str, *args) -> None:
        now = time.monotonic()
        if now - self._last.get(kind, -self.period) < self.period:
            self._held[kind] = self._held.get(kind, 0) + 1
            return
        held = self._held.pop(kind, 0)
        self._last[kind] = now
        suffix = f" (and {held} more like it in the last {self.period:.0f} s)" if held else ""
        self.logger.warning(message + suffix, *args)


class CallerGone(Exception):
    """The caller ended its call before our answer: there is nobody left to answer."""


async def refuse(context: grpc.aio.ServicerContext, code: grpc.StatusCode, detail: str) -> None:
    """End the call with `code` (raises AbortError), or CallerGone when the caller already ended it:
    then the status cannot be sent (gRPC's own error for that is not the handler's fault)."""
    try:
        await context.abort(code, detail)
    except (grpc.aio.AbortError, grpc.aio.UsageError):
        raise
    except Exception as exc:  # gRPC's core refused to send the status: the call is over
        raise CallerGone(f"the caller left before we could answer {code.name}: {detail}") from exc


class MalformedMessage(Exception):
    """Bytes on a stream that do not parse as the method's request type."""


class _Malformed:
    """Stands in for a unary request that did not parse (raising there would end the call UNKNOWN)."""

    def __init__(self, error: str):
        self.error = error


class HostileInputGuard(grpc.aio.ServerInterceptor):
    """Parses every request itself: bytes that are not a valid message end the call with
    INVALID_ARGUMENT and one rate-limited warning line, never UNKNOWN and a traceback.

    Applies to every service of the server it is installed on (ours, health, reflection). A
    servicer that reads a stream in a task of its own catches MalformedMessage itself.
    """

    def __init__(self, warnings: RateLimitedWarnings | None = None, on_reject=None):
        self.warnings = warnings or RateLimitedWarnings(log)
        self.on_reject = on_reject  # called with a reason label (telemetry)

    async def reject(self, context: grpc.aio.ServicerContext, method: str, error: str) -> None:
        self.warnings.warn("malformed", "malformed request to %s from %s: %s", method, context.peer(), error)
        if self.on_reject is not None:
            self.on_reject("malformed")
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {error}")

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = details.method
        parse = handler.request_deserializer
        streaming = handler.request_streaming

        def deserialize(data: bytes):
            try:
                return parse(data)
            except (DecodeError, ValueError, TypeError) as exc:  # protobuf raises DecodeError (a ValueError)
                detail = str(exc)[:200] or type(exc).__name__
                if streaming:
                    raise MalformedMessage(detail) from None
                return _Malformed(detail)

        behavior = (handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream)
        guard = self
        if inspect.isasyncgenfunction(behavior):
            async def guarded(request, context):
                if isinstance(request, _Malformed):
                    await guard.reject(context, method, request.error)
                    return
                try:
                    async for response in behavior(request, context):
                        yield response
                except MalformedMessage as exc:
                    await guard.reject(context, method, str(exc))
        else:
            async def guarded(request, context):
                if isinstance(request, _Malformed):
                    await guard.reject(context, method, request.error)
                try:
                    result = behavior(request, context)
                    return (await result) if inspect.isawaitable(result) else result
                except MalformedMessage as exc:
                    await guard.reject(context, method, str(exc))

        make = {(False, False): grpc.unary_unary_rpc_method_handler,
                (False, True): grpc.unary_stream_rpc_method_handler,
                (True, False): grpc.stream_unary_rpc_method_handler,
                (True, True): grpc.stream_stream_rpc_method_handler}[(streaming, handler.response_streaming)]
        return make(guarded, request_deserializer=deserialize, response_serializer=handler.response_serializer)


def make_server(*, max_receive_bytes: int, max_send_bytes: int | None = None,
                max_concurrent_streams: int = MAX_CONCURRENT_STREAMS, guard: HostileInputGuard | None = None
                ) -> grpc.aio.Server:
    """A grpc.aio server with the project's limits and the hostile-input guard on every method."""
    return grpc.aio.server(interceptors=[guard or HostileInputGuard()],
                           options=options(max_receive_bytes, max_send_bytes=max_send_bytes,
                                           max_concurrent_streams=max_concurrent_streams))


def add_health_and_reflection(server: grpc.aio.Server, service_names: list[str]) -> health.aio.HealthServicer:
    """Standard health checking (all services SERVING once started) and reflection."""
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    return servicer


async def set_serving(servicer: health.aio.HealthServicer, service_names: list[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_names]:
        await servicer.set(name, status)


async def check_health(address: str, service: str = "", timeout: float = 5.0, tls=None,
                       server_name: str | None = None) -> bool:
    """True when the gRPC health service at address answers SERVING (over mTLS when tls is given)."""
    from services.common.tls import channel as open_channel

    async with open_channel(address, tls, server_name=server_name) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING


def run(main):
    """Run a coroutine to completion on uvloop (asyncio's own loop where uvloop is missing)."""
    try:
        import uvloop
        factory = uvloop.new_event_loop
    except ImportError:  # not on every platform; asyncio's default loop works too
        logging.getLogger(__name__).info("uvloop not available, using the default event loop")
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)

