"""Who may join a run, and in which slot: a joining worker's identity (its certificate, or the name it
claims under --insecure), its run, its data (shapes, classes, sizes), the slot and shard size it gets,
and how its discriminators reach it (pushed to its Peer address, or through the relay). Every refusal
is a JoinRefused with the gRPC status the Coordinator ends the call with."""

from __future__ import annotations

import math
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mdgan.config import DATASETS, SPLITS, TrainingConfig
from mdgan.data import shard_sizes
from mdgan.images import check_class_names, model_image_shape, resizable
from mdgan.roster import RejoinPlan, Roster, SlotRefused
from mdgan.sites import RunClasses
from services.common import pki
from services.common import tls as tls_
from services.common.proto import coordinator_pb2 as pb
from services.common.tls import TLSConfig, peer_certificate, peer_certificate_pem

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
class Relayed:
    """A worker whose swaps go through the relay: why, and its certificate (PEM), which senders seal for."""

    reason: str
    certificate: bytes


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




class AdmissionDesk:
    """Admits joins into `roster`'s slots for the run of `config` (run_id), under `admission`'s rules;
    handle_class: the run's algorithm's handle (whether it takes late joiners, whether it swaps peer to
    peer); classes: the run's class names (declared, or set by the first site with class folders)."""

    def __init__(self, config: TrainingConfig, roster: Roster, run_id: str, admission: Admission, handle_class,
                 class_names: tuple[str, ...] | None = None):
        self.config = config
        self.roster = roster
        self.run_id = run_id
        self.handle_class = handle_class
        self.peer_probe = admission.peer_probe  # None: a worker's advertised address is taken on trust
        self.finished_runs = frozenset(admission.finished_runs) - {run_id}  # earlier runs of this server, ended
        self.authenticated = admission.authenticated
        self.allowed_workers = set(admission.allowed_workers) if admission.allowed_workers else None
        self.classes = RunClasses(class_names, config.model.num_classes, config.model.conditional)

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

    def admit(self, join: pb.Join, identity: str | None) -> AdmittedWorker:
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
        self.check_data(join)
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

    async def swap_path(self, join: pb.Join, identity: str | None, context) -> Relayed | None:
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

    def check_data(self, join: pb.Join) -> None:
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
