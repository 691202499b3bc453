"""The Coordinator service: admits workers, and gives each admitted worker's stream to the handle of
the run's algorithm (services/server/algorithms/), which the training loop holds.

Admission is the same for every algorithm: identity (certificate or claimed name), roster slot,
data checks, the Welcome with the run's spec. What follows on the stream belongs to the
connection (services/server/connection.py) and the algorithm's handle.
"""

from __future__ import annotations

import asyncio
import logging
import dataclasses
import math
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mdgan.algorithms.base import WorkerLost
from mdgan.config import DATASETS, SPLITS, TrainingConfig
from mdgan.data import shard_sizes
from mdgan.sites import RunClasses
from mdgan.images import check_class_names, model_image_shape, resizable
from mdgan.roster import RejoinPlan, Roster, SlotRefused
from services.common import pki, training_spec
from services.common.rpc import FINISHED_RUN_KEY, RateLimitedWarnings
from services.common.telemetry import Telemetry
from services.common import tls as tls_
from services.common.tls import TLSConfig, peer_certificate, peer_certificate_pem
from services.common.proto import coordinator_pb2 as pb
from services.common.proto import coordinator_pb2_grpc
from services.server.algorithms import ALGORITHMS
from services.server.connection import StreamHandle, WorkerConnection

log = logging.getLogger("mdgan.server")

MAX_PENDING_JOINS = 32  # streams that opened but have not been admitted yet (each waits for its join)
MAX_ADDRESS_CHARS = 255
MAX_SAMPLES = 1 << 40  # a bound on shard and dataset sizes: beyond it a number is nonsense, not data


class JoinRefused(Exception):
    def __init__(self, code: grpc.StatusCode, detail: str, finished_run: str = ""):
        super().__init__(detail)
        self.code = code
        self.detail = detail
        self.finished_run = finished_run  # the worker's run, known to have ended


class PeerProbe:
    """Dials a joining worker's advertised Peer address, as the other workers will to push their
    discriminators to it, and asks its health service: an address the other machines cannot reach is
    found at join, said in one line, instead of as failed swaps every round."""

    def __init__(self, tls: TLSConfig | None, timeout: float = 5.0):
        self.tls = tls
        self.timeout = timeout

    async def unreachable(self, address: str, identity: str | None) -> str | None:
        """Why `address` does not answer as `identity`'s Peer service (None: it does)."""
        try:
            async with tls_.channel(address, self.tls, server_name=identity if self.tls else None) as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                                       timeout=self.timeout)
        except grpc.aio.AioRpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
        except ValueError as exc:  # an address gRPC cannot parse
            return str(exc)
        return None if reply.status == health_pb2.HealthCheckResponse.SERVING else "its Peer service is not serving"


@dataclass(frozen=True)
class Deadlines:
    """How often the server speaks when idle, and how long it waits for a worker (seconds)."""

    heartbeat_interval: float = 5.0
    swap_timeout: float = 60.0
    liveness_timeout: float = 60.0  # a worker silent this long is lost
    join_read_timeout: float = 30.0  # a stream that sends no Join this long is closed


@dataclass(frozen=True)
class Admission:
    """Who may join: under mutual TLS (`authenticated`) a worker certificate or a name on `allowed_workers`;
    never a worker of a run this server finished; a Peer address checked by `peer_probe` (None: on trust)."""

    authenticated: bool = False
    allowed_workers: tuple[str, ...] | None = None
    finished_runs: frozenset[str] = frozenset()
    peer_probe: PeerProbe | None = None


@dataclass(frozen=True)
class AdmittedWorker:
    """A join accepted: its message, the slot and shard size it got, its identity, how it gets its D."""

    join: pb.Join
    index: int
    size: int
    identity: str
    plan: RejoinPlan
    relay: Relayed | None = None  # its discriminators come through the relay (None: pushed to its peer_address)


SUPERSEDE_WAIT_S = 5.0  # the most a rejoin waits for the stale stream it replaces to leave the roster


@dataclass(frozen=True)
class Relayed:
    """A worker whose swaps go through the relay: why, and its certificate (PEM), which senders seal for."""

    reason: str
    certificate: bytes


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
        self.peer_probe = admission.peer_probe  # None: a worker's advertised address is taken on trust
        self.finished_runs = frozenset(admission.finished_runs) - {run_id}  # earlier runs of this server, ended
        # The run's algorithm adds its own options to the Welcome's TrainingSpec (P-WGAN's T, eta, ...).
        self.describe_run = describe_run
        self.authenticated = admission.authenticated
        self.allowed_workers = set(admission.allowed_workers) if admission.allowed_workers else None
        self._pending_joins = 0
        self.warnings = RateLimitedWarnings(log)  # a flood of bad joins makes a few lines, not a flood
        # The run's class names: declared (--classes) or set by the first site with class folders.
        self.classes = RunClasses(class_names, config.model.num_classes, config.model.conditional)
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
        if not self.authenticated or identity is None:
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

    def identify(self, join: pb.Join, context: grpc.aio.ServicerContext) -> str | None:
        """The joining worker's identity; None: unnamed (insecure mode only; named after its shard)."""
        if not self.authenticated:
            if join.name and not pki.NAME_PATTERN.match(join.name):
                raise JoinRefused(grpc.StatusCode.INVALID_ARGUMENT, f"{join.name[:64]!r} is not a valid worker name")
            return join.name or None
        identity, role = peer_certificate(context)
        if identity is None:  # cannot happen with require_client_auth; refuse rather than trust
            raise JoinRefused(grpc.StatusCode.UNAUTHENTICATED, "no client certificate")
        if self.allowed_workers is not None:
            if identity not in self.allowed_workers:
                raise JoinRefused(grpc.StatusCode.PERMISSION_DENIED, f"{identity!r} is not on --allowed-workers")
        elif role != pki.ROLE_WORKER:
            raise JoinRefused(grpc.StatusCode.PERMISSION_DENIED,
                              f"{identity!r} holds a {role or 'role-less'} certificate, not a worker's "
                              f"(OU={pki.ROLE_WORKER}); or list it in --allowed-workers")
        return identity

    def _admit(self, join: pb.Join, identity: str | None) -> AdmittedWorker:
        """A joining worker's slot, shard size, identity and how it gets its discriminator; raises JoinRefused."""
        cfg = self.config
        if join.run_id and self.run_id and join.run_id != self.run_id:
            if join.run_id in self.finished_runs:
                raise JoinRefused(grpc.StatusCode.FAILED_PRECONDITION, (
                    f"this worker's run {join.run_id!r} has ended (it was away at the end); this server runs run "
                    f"{self.run_id!r}: forget the ended run and join again"), finished_run=join.run_id)
            raise JoinRefused(grpc.StatusCode.FAILED_PRECONDITION, (
                f"this worker belongs to run {join.run_id!r}, but this server runs run {self.run_id!r}; "
                f"point it at its own run's server, or empty its --state-dir to join run {self.run_id!r}"))
        if self.handle_class.late_join_refusal and self.roster.started:
            raise JoinRefused(grpc.StatusCode.FAILED_PRECONDITION, self.handle_class.late_join_refusal)
        if len(join.peer_address) > MAX_ADDRESS_CHARS or len(join.sample_shape) > 8 or len(join.image_shape) > 8 \
                or join.shard_size > MAX_SAMPLES or join.dataset_size > MAX_SAMPLES:
            raise JoinRefused(grpc.StatusCode.INVALID_ARGUMENT, "absurd join: address, shape or sizes out of bounds")
        self._check_data(join)
        if cfg.workers > 1 and not join.peer_address and not join.relayed:
            raise JoinRefused(grpc.StatusCode.INVALID_ARGUMENT, "a peer address is needed for the discriminator swap")
        if join.HasField("shard_index"):
            index, size = join.shard_index, join.shard_size
            if index >= cfg.workers:
                raise JoinRefused(grpc.StatusCode.INVALID_ARGUMENT, f"shard index {index} >= workers {cfg.workers}")
        else:
            held = self.roster.slot_bound_to(identity) if identity is not None else None
            taken = {self.roster.slot_of(w) for w in self.roster.alive()}

            def unbound(i: int) -> bool:  # (unnamed workers cannot be told apart: any may take an unnamed one's)
                owner = self.roster.bindings.get(i)
                return owner is None or (identity is None and owner == f"worker-{i}")

            # an identity coming back gets its own slot; others get the lowest slot nobody holds
            free = [held] if held is not None else [i for i in range(cfg.workers) if i not in taken and unbound(i)]
            if not free:
                raise JoinRefused(grpc.StatusCode.RESOURCE_EXHAUSTED, f"all {cfg.workers} shards have a worker")
            index = free[0]
            if join.own_data:  # a site: its m is all of its data
                size = join.shard_size
            elif join.dataset_size < cfg.workers:
                raise JoinRefused(grpc.StatusCode.INVALID_ARGUMENT, f"a dataset of {join.dataset_size} samples cannot "
                                                                    f"be cut into {cfg.workers} shards")
            else:
                size = shard_sizes(join.dataset_size, cfg.workers)[index]
        if size < cfg.batch_size:
            raise JoinRefused(grpc.StatusCode.INVALID_ARGUMENT, f"shard of {size} samples < batch size {cfg.batch_size}")
        identity = identity or f"worker-{index}"  # an unnamed worker (--insecure) is named after its slot
        try:
            self.roster.claim(index, identity)
        except SlotRefused as refused:
            code = {"taken_by_other": grpc.StatusCode.PERMISSION_DENIED, "busy": grpc.StatusCode.ALREADY_EXISTS,
                    "full": grpc.StatusCode.RESOURCE_EXHAUSTED}.get(refused.kind, grpc.StatusCode.INVALID_ARGUMENT)
            raise JoinRefused(code, f"shard {index}: {refused}") from None
        classes = tuple(join.class_names) if join.class_names else (() if join.own_data and not join.num_classes
                                                                    else None)
        why = self.classes.check(classes, join.num_classes)  # last: a refused join must not fix the run's classes
        if why:
            raise JoinRefused(grpc.StatusCode.INVALID_ARGUMENT, f"this worker's classes do not fit the run: {why}")
        # Only what this run saved counts as the worker's state.
        same_run = bool(join.run_id) and join.run_id == self.run_id
        plan = self.roster.rejoin_plan(list(join.checkpoints) if same_run else [],
                                       join.trained_iteration if same_run else 0)
        return AdmittedWorker(join, index, size, identity, plan)

    async def _swap_path(self, join: pb.Join, identity: str | None, context) -> Relayed | None:
        """How the worker gets its discriminators: through the relay when it asks (it takes no inbound
        connection) or when this server cannot reach its advertised Peer address (the other workers, which
        would push there, could not either); pushed to its address otherwise. Without mutual TLS there is no
        relay (its pushes are sealed between the sites' certificates): an unreachable worker is refused."""
        if not self.handle_class.peer_to_peer or self.config.workers < 2:
            return None
        certificate = peer_certificate_pem(context) if self.authenticated else None
        if join.relayed:
            if certificate is None:
                raise JoinRefused(grpc.StatusCode.FAILED_PRECONDITION, (
                    "this worker asks for relayed swaps, which need mutual TLS (they are sealed between the sites' "
                    "certificates): give it and the server certificates, or serve its Peer service (--swaps direct)"))
            return Relayed("it takes no inbound connection (--swaps relay)", certificate)
        if self.peer_probe is None or not join.peer_address or len(join.peer_address) > MAX_ADDRESS_CHARS:
            return None  # (no address, or an absurd one: _admit says why)
        why = await self.peer_probe.unreachable(join.peer_address, identity)
        if why and certificate is not None and join.relay_fallback:
            return Relayed(f"the server cannot reach its Peer service at {join.peer_address} ({why})", certificate)
        if why:
            raise JoinRefused(grpc.StatusCode.FAILED_PRECONDITION, (
                f"this worker's Peer service cannot be reached at {join.peer_address!r} ({why}), where the other "
                f"workers would push their discriminators: set --advertise-address (MDGAN_ADVERTISE_ADDRESS) to the "
                f"HOST:PORT the other machines reach it at, or let its swaps go through the server's relay "
                f"(mdgan-worker --swaps auto or relay, under mutual TLS)"))
        return None

    def _check_data(self, join: pb.Join) -> None:
        """The worker's samples fit the model: the same flat shape, or images it can resize to the model's."""
        model = self.config.model
        malformed = check_class_names(tuple(join.class_names))
        if malformed:
            raise JoinRefused(grpc.StatusCode.INVALID_ARGUMENT, f"bad class names: {malformed}")
        if join.image_shape:
            image = tuple(join.image_shape)
            try:
                target = model_image_shape(model.sample_shape)
            except ValueError as exc:
                raise JoinRefused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
            if not resizable(image, target):
                raise JoinRefused(grpc.StatusCode.INVALID_ARGUMENT, (
                    f"this worker's images of shape {image} (C, H, W) cannot be resized to the model's {target}: "
                    "not 1 or 3 channels, or another aspect ratio"))
        elif tuple(join.sample_shape) != tuple(model.sample_shape):
            raise JoinRefused(grpc.StatusCode.INVALID_ARGUMENT, (
                f"data of shape {tuple(join.sample_shape)} does not fit the model's samples "
                f"{tuple(model.sample_shape)}"))
        if not join.own_data and join.num_classes != model.num_classes:
            raise JoinRefused(grpc.StatusCode.INVALID_ARGUMENT, (
                f"data with {join.num_classes} classes does not fit the model ({model.num_classes} classes)"))
        if join.HasField("split"):
            split = join.split
            if join.own_data or split.dataset not in DATASETS or split.split not in SPLITS \
                    or not (math.isfinite(split.dirichlet_alpha) and split.dirichlet_alpha > 0) \
                    or split.max_samples > MAX_SAMPLES:
                raise JoinRefused(grpc.StatusCode.INVALID_ARGUMENT, (
                    f"bad split of the shared dataset: {split.dataset[:40]!r}, {split.split[:40]!r}, alpha "
                    f"{split.dirichlet_alpha}" + (" (a site with its own data has no split)" if join.own_data else "")))

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
        spec.class_names.extend(self.classes.names or ())
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
            identity = self.identify(join, context)
            await self._supersede(identity, context)
            relay = await self._swap_path(join, identity, context)
            admitted = dataclasses.replace(self._admit(join, identity), relay=relay)
        except JoinRefused as refused:
            self.warnings.warn(refused.code.name, "join refused (%s, %s): %s", context.peer(), refused.code.name,
                               refused.detail)
            if refused.code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
                self.telemetry.rejected.labels("identity").inc()
            await context.abort(refused.code, refused.detail, trailing_metadata=(
                ((FINISHED_RUN_KEY, refused.finished_run),) if refused.finished_run else ()))
        return admitted
