"""The Coordinator service: admits workers, and gives each admitted worker's stream to the handle of
the run's algorithm (services/server/algorithms/), which the training loop holds.

Admission is the same for every algorithm (admission.py: identity, run, data checks, roster slot,
swap path); then the Welcome with the run's spec. What follows on the stream belongs to the
connection (services/server/connection.py) and the algorithm's handle.
"""

from __future__ import annotations

import asyncio
import logging
import dataclasses
from dataclasses import dataclass

import grpc

from mdgan.algorithms.base import WorkerLost
from mdgan.config import TrainingConfig
from mdgan.roster import Roster
from services.common import training_spec
from services.common.rpc import FINISHED_RUN_KEY, RateLimitedWarnings
from services.common.telemetry import Telemetry
from services.common.proto import coordinator_pb2 as pb
from services.common.proto import coordinator_pb2_grpc
from services.server.admission import Admission, AdmissionDesk, AdmittedWorker, JoinRefused
from services.server.algorithms import ALGORITHMS
from services.server.connection import StreamHandle, WorkerConnection

log = logging.getLogger("mdgan.server")

MAX_PENDING_JOINS = 32  # streams that opened but have not been admitted yet (each waits for its join)
@dataclass(frozen=True)
class Deadlines:
    """How often the server speaks when idle, and how long it waits for a worker (seconds)."""

    heartbeat_interval: float = 5.0
    swap_timeout: float = 60.0
    liveness_timeout: float = 60.0  # a worker silent this long is lost
    join_read_timeout: float = 30.0  # a stream that sends no Join this long is closed


SUPERSEDE_WAIT_S = 5.0  # the most a rejoin waits for the stale stream it replaces to leave the roster


class Coordinator(coordinator_pb2_grpc.CoordinatorServicer):
    """Admits workers into the roster's slots, at any time (they take part from the next iteration
    boundary), and refuses those of another run or another identity.

    Under mutual TLS (`authenticated`) a worker's identity is the name in its client certificate,
    which gRPC has verified against the run's CA; it must be a worker certificate (or be on
    `allowed_workers`). With --insecure it is the name the worker claims in its Join. The roster
    binds each slot to the first identity that holds it.
    """

    def __init__(self, config: TrainingConfig, *, telemetry: Telemetry | None = None,
                 deadlines: Deadlines = Deadlines(), admission: Admission = Admission(),
                 algorithm: str = "mdgan", model_layouts: dict[str, dict] | None = None, roster: Roster | None = None,
                 run_id: str = "", swap_round=lambda: 0, class_names: tuple[str, ...] | None = None,
                 describe_run=None):
        self.config = config
        # The run's algorithm adds its own options to the Welcome's TrainingSpec (P-WGAN's T, eta, ...).
        self.describe_run = describe_run
        self._pending_joins = 0
        self.warnings = RateLimitedWarnings(log)  # a flood of bad joins makes a few lines, not a flood
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)})")
        self.algorithm = algorithm
        self.handle_class: type[StreamHandle] = ALGORITHMS[algorithm].handle
        self.model_layouts = model_layouts
        self.telemetry = telemetry or Telemetry("server")
        self.telemetry.workers_expected.set(config.workers)
        self.telemetry.run_iterations.set(config.iterations)
        self.heartbeat_interval = deadlines.heartbeat_interval
        self.swap_timeout = deadlines.swap_timeout
        self.liveness_timeout = deadlines.liveness_timeout
        self.join_read_timeout = deadlines.join_read_timeout
        self.roster = roster or Roster(config.workers)
        self.run_id = run_id
        self.swap_round = swap_round  # swap rounds done so far (the Trainer's count)
        self.workers: dict[int, StreamHandle] = {}  # slot -> the latest handle (for the summary's shard sizes)
        self._open: set[WorkerConnection] = set()  # the streams whose calls are under way
        self.desk = AdmissionDesk(config, self.roster, run_id, admission, self.handle_class, class_names)
        self.run_state = self.handle_class.run_state(self)  # what the algorithm's handles share

    async def wait_for_workers(self, timeout: float) -> list[StreamHandle]:
        """Block until every slot has a live worker (FL-GAN, whose rounds take a fixed set)."""
        if not await self.roster.wait_for(self.config.workers, timeout):
            raise self.roster.short_of(self.config.workers, timeout)
        self.roster.started = True
        return self._live()

    def end_streams(self) -> None:
        """The server is stopping: end every worker's call from our side, so that each returns by itself
        (cancelled by the gRPC server's stop instead, each logged a CancelledError traceback). Workers
        whose stream ends without a stop message reconnect, to this server's successor."""
        for connection in list(self._open):
            connection.end("the server is stopping")

    async def fail_run(self, cause: str, timeout: float = 5.0) -> None:
        """The run failed on the server: every connected worker is told (a failed stop) and exits,
        instead of waiting for a successor that nobody will start."""
        stop = pb.ServerMessage(stop=pb.Stop(reason=cause, failed=True))

        async def tell(connection: WorkerConnection) -> None:
            try:
                await asyncio.wait_for(connection.send(stop), timeout)
            except (WorkerLost, asyncio.TimeoutError):
                pass
            finally:
                connection.closed.set()

        await asyncio.gather(*(tell(c) for c in list(self._open)))

    async def _supersede(self, identity: str | None, context) -> None:
        """An authenticated identity that connects again while its old stream looks alive here has lost that
        stream (a NAT or a proxy dropped it without a word): the old one is given up now, so that the worker
        rejoins at once instead of being refused as busy until a deadline finds the old one dead. Not under
        --insecure, where a name is only a claim."""
        if not self.desk.authenticated or identity is None:
            return
        stale = [w for w in self._live() if w.identity == identity]
        for worker in stale:
            log.warning("%s (%s) connected again from %s: its old stream is given up", worker.worker_id, identity,
                        context.peer())
            worker.connection.lose("superseded: the same identity connected again")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SUPERSEDE_WAIT_S
        while stale and any(w.identity == identity for w in self._live()) and loop.time() < deadline:
            await asyncio.sleep(0.05)  # (the old stream's end takes the worker off the roster)

    def member_identities(self) -> set[str]:
        """Every identity bound to a slot of this run, or taking part now."""
        return set(self.roster.bindings.values()) | {w.identity for w in self._live()}

    def _live(self) -> list[StreamHandle]:
        return self.roster.alive()

    async def Train(self, request_iterator, context: grpc.aio.ServicerContext) -> None:
        if self._pending_joins >= MAX_PENDING_JOINS:
            # transient, unlike a full run (RESOURCE_EXHAUSTED): a worker retries UNAVAILABLE with backoff
            await context.abort(grpc.StatusCode.UNAVAILABLE, "too many joins in progress; try again shortly")
        self._pending_joins += 1
        try:
            admitted = await self._join(context)
        finally:
            self._pending_joins -= 1
        join, index, plan = admitted.join, admitted.index, admitted.plan
        connection = WorkerConnection(index, admitted.size, join, context, self.telemetry, self.liveness_timeout,
                                      admitted.identity,
                                      on_fault=lambda cause: self.roster.fault(index, admitted.identity, cause),
                                      relayed_certificate=admitted.relay.certificate if admitted.relay else None)
        worker = self.handle_class(connection, self.run_state, needs_copy=plan.copy)
        self.workers[index] = worker
        self.roster.arrive(index, admitted.identity, worker)  # takes part from the next iteration boundary
        self.telemetry.joins.inc()
        self.telemetry.workers_alive.set(len(self._live()))
        relay = admitted.relay
        log.info("%s joined as %r from %s (%s of %d samples; swaps %s)%s", worker.worker_id, worker.identity,
                 context.peer(), "its own data" if join.own_data else "a shard", admitted.size,
                 f"through the relay: {relay.reason}" if relay else f"direct, at {join.peer_address or '-'}",
                 f": restores its state of iteration {plan.restore}" if plan.restore
                 else ": takes a copy of a peer's discriminator" if plan.copy else "")
        spec = training_spec.spec_from_config(self.config, self.algorithm)
        spec.class_names.extend(self.desk.classes.names or ())
        if self.describe_run is not None:
            self.describe_run(spec)
        # every identity bound in this run: a discriminator one of them pushes early is kept for the order
        members = sorted(self.member_identities())
        try:
            await connection.send(pb.ServerMessage(welcome=pb.Welcome(
                worker_id=worker.worker_id, shard_index=index, spec=spec,
                heartbeat_interval_ms=int(self.heartbeat_interval * 1000), swap_timeout_ms=int(self.swap_timeout * 1000),
                run_id=self.run_id, swap_round=self.swap_round(), restore_iteration=plan.restore, copy=plan.copy,
                identity=worker.identity, members=members, relayed=relay is not None,
                relay_reason=relay.reason if relay else "")))
        except WorkerLost:
            self.roster.depart(worker)
            return
        reader = asyncio.create_task(connection.read_loop())
        beats = asyncio.create_task(connection.heartbeats(self.heartbeat_interval))
        self._open.add(connection)
        try:
            await connection.closed.wait()
        finally:  # also on cancellation, when the worker's connection drops
            self._open.discard(connection)
            connection.lose("stream ended")
            self.roster.depart(worker)
            self.telemetry.workers_alive.set(len(self._live()))
            reader.cancel()
            beats.cancel()
        if connection.malformed is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed message: {connection.malformed}")

    async def _join(self, context: grpc.aio.ServicerContext) -> AdmittedWorker:
        """Read and admit the first message; every refusal ends the call with its status."""
        try:
            first = await asyncio.wait_for(context.read(), self.join_read_timeout)
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "no join message in time")
        if first is grpc.aio.EOF or first.WhichOneof("body") != "join":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message must be a join")
        self.telemetry.count("worker_to_server", "control", "receiver", first)
        join = first.join
        try:
            identity = self.desk.identify(join, context)
            await self._supersede(identity, context)
            relay = await self.desk.swap_path(join, identity, context)
            admitted = dataclasses.replace(self.desk.admit(join, identity), relay=relay)
        except JoinRefused as refused:
            self.warnings.warn(refused.code.name, "join refused (%s, %s): %s", context.peer(), refused.code.name,
                               refused.detail)
            if refused.code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
                self.telemetry.rejected.labels("identity").inc()
            await context.abort(refused.code, refused.detail, trailing_metadata=(
                ((FINISHED_RUN_KEY, refused.finished_run),) if refused.finished_run else ()))
        return admitted
