"""A worker: who it is to its server and peers, what it trains on (holding.py), what it keeps on its
disk (run_state.py), the run's algorithm, and what that algorithm may use of it (context.py).

Its sessions with the server (connect, join, heartbeats, reconnects with backoff, stop) are
session.py's. What the server's messages mean is the business of the run's algorithm
(services/worker/algorithms/, picked by the welcome's spec.algorithm): the node hands each message
body to it. MD-GAN's peer-to-peer part (the Peer service, mailboxes) is in services/worker/peer.py."""

from __future__ import annotations

import asyncio
import logging

import grpc

from dataclasses import dataclass, replace

from services.common import training_spec
from services.common.proto import coordinator_pb2 as pb
from services.common.telemetry import Telemetry
from services.common.tls import TLSConfig
from services.worker.algorithms import ALGORITHMS
from services.worker.algorithms.base import ServerGone, StreamBroken, WorkerAlgorithm, WorkerFailed
from services.worker.faults import FaultReport
from services.worker.holding import HeldData, WorkerData  # noqa: F401  (WorkerData: re-exported)
from services.worker.run_state import RunState, WorkerState  # noqa: F401  (WorkerState: re-exported)
from services.worker.session import FINAL_REFUSALS, JoinRefused, ServerSessions  # noqa: F401  (re-exported)

log = logging.getLogger("mdgan.worker")


@dataclass(frozen=True)
class ServerLink:
    """How a worker reaches its server, who it is to it, and how long it waits for it."""

    address: str
    tls: TLSConfig | None = None  # None: --insecure
    identity: str = ""  # "" : the certificate's
    server_name: str | None = None
    connect_timeout: float = 300.0
    server_timeout: float = 120.0
    run_deadline: float = 7 * 24 * 3600.0
    reconnect: bool = True


@dataclass(frozen=True)
class SitePolicy:
    """The site's own limits, and the emulations experiments use (mdgan-worker --attack, --slow-factor)."""

    swap_check: str | None = None  # this site's own --swap-check on|off; None: as the run says
    dp_max_epsilon: float = 0.0  # > 0: leave the run rather than spend more (DP runs)
    privacy_dir: str | None = None  # where the site keeps its privacy ledgers (None: its state dir)
    dp_fixed_noise: int | None = None  # research and tests only: the site's noise from this number, not a secret
    attack: str | None = None  # a Byzantine worker
    slow_factor: float = 1.0  # a straggler


SWAP_PATHS = ("auto", "direct", "relay")


class WorkerNode:
    """One worker: what it trains on (WorkerData), how it reaches the server (ServerLink), its durable
    state (WorkerState) and its site's policy (SitePolicy)."""

    def __init__(self, link: ServerLink, data: WorkerData, *, advertise_address: str = "",
                 state: WorkerState = WorkerState(), policy: SitePolicy = SitePolicy(),
                 telemetry: Telemetry | None = None, device: str = "cpu"):
        self.data = HeldData(data)  # what it trains on, and what its joins say of it
        self.telemetry = telemetry or Telemetry("worker")
        self.device = device  # this worker's own choice; the run's spec does not carry one
        self.policy = policy
        self.server_address = link.address
        self.advertise_address = advertise_address  # (known once the Peer service listens)
        self.connect_timeout = link.connect_timeout
        self.server_timeout = link.server_timeout
        self.run_deadline = link.run_deadline
        self.algorithm: WorkerAlgorithm | None = None  # the run's, built at its first welcome
        self._traffic = WorkerAlgorithm.traffic
        self.worker_id = ""
        self._write_lock = asyncio.Lock()
        self.swap_timeout = 60.0
        self.tls = link.tls
        self.identity = link.identity or (link.tls.identity if link.tls else "")
        self.server_name = link.server_name
        self.reconnect = link.reconnect
        self.run_state = RunState(state, policy.privacy_dir, policy.dp_fixed_noise)  # the run it is in, on disk
        self.run_state.shard_index = data.shard.index if data.shard is not None else None
        self.faults = FaultReport(lambda: self.worker_id or self.identity or "this worker", self.write)
        self.task: asyncio.Task | None = None  # the task running run(): a fault ends it
        self.call = None  # the Train stream of the session under way (None: between sessions)
        self.swaps = "direct"  # SWAP_PATHS: how discriminators reach this site
        self.peer_servicer = None  # the Peer service's receiving code, which relayed pushes go to as well
        self.server_channel: grpc.aio.Channel | None = None  # the session's channel (relayed pushes go over it)

    def peer_inbox(self):
        """The run's receiving side of pushed discriminators (the Peer service's; None: not an MD-GAN run)."""
        return self.algorithm.peer_inbox() if self.algorithm is not None else None

    async def write(self, call, message: pb.WorkerMessage) -> None:
        try:
            async with self._write_lock:
                await call.write(message)
        except asyncio.InvalidStateError:
            # The server ended the stream while we stepped on a batch it had sent: it dropped us (we
            # were paused past its deadline) or it is gone. A broken stream, as if found by a read:
            # reconnect and rejoin (before, the worker ended with a traceback).
            code = await call.code()
            raise StreamBroken(f"the stream ended before our answer was sent (the server dropped us or is gone): "
                               f"{code.name} {await call.details()}") from None
        kind, payload = self._traffic(message.WhichOneof("body"), message)
        self.telemetry.count("worker_to_server", kind, "sender", message, payload)

    async def read(self, call):
        try:
            async with asyncio.timeout(self.server_timeout):  # (wait_for would make a task per read)
                message = await call.read()
        except asyncio.TimeoutError:
            raise StreamBroken(f"no word from the server for {self.server_timeout:.0f} s") from None
        if message is grpc.aio.EOF:
            code = await call.code()
            raise StreamBroken(f"the server closed the stream: {code.name} {await call.details()}")
        kind, payload = self._traffic(message.WhichOneof("body"), message)
        self.telemetry.count("server_to_worker", kind, "receiver", message, payload)
        return message

    def join_message(self) -> pb.WorkerMessage:
        join = self.data.join()
        join.peer_address = "" if self.swaps == "relay" else self.advertise_address
        join.relayed = self.swaps == "relay"
        join.relay_fallback = self.swaps == "auto" and self.tls is not None
        join.name = self.identity
        if self.run_state.run_id:
            join.run_id = self.run_state.run_id
            join.checkpoints.extend(self.run_state.held())
            join.trained_iteration = self.algorithm.trained_iteration if self.algorithm is not None else 0
        return pb.WorkerMessage(join=join)

    async def run(self) -> str:
        """Join, train until told to stop; returns the stop reason (services/worker/session.py)."""
        return await ServerSessions(self).run()

    # -- faults (services/worker/faults.py) --------------------------------------------------------
    def fail(self, where: str, exc: BaseException) -> WorkerFailed:
        """This worker's own exception while `where` ("answering batches", ...): logged with its
        traceback, told to the server as a Fault, and the worker exits 1. Raised by the task that runs
        the worker, the WorkerFailed returned ends its session; from any other task (a swap, the Peer
        service) the Fault is written on the stream now, and the server ends the session."""
        trained = self.algorithm.trained_iteration if self.algorithm is not None else 0
        return self.faults.record(where, exc, trained, self.task, lambda: self.call)

    @property
    def fault(self) -> pb.Fault | None:
        return self.faults.fault

    async def on_welcome(self, welcome: pb.Welcome) -> None:
        run = self.run_state
        if run.pinned_run and welcome.run_id != run.pinned_run:
            raise JoinRefused(f"the server runs run {welcome.run_id!r}, and this worker joins run "
                              f"{run.pinned_run!r} only (--run-id)")
        if run.run_id and welcome.run_id and welcome.run_id != run.run_id:
            raise JoinRefused(f"the server runs run {welcome.run_id!r}, this worker was in run {run.run_id!r}")
        config = replace(training_spec.config_from_spec(welcome.spec), device=self.device).validate()
        if welcome.run_id:
            run.run_id = welcome.run_id
        name = welcome.spec.algorithm or "mdgan"
        if self.algorithm is not None and self.algorithm.name == name and self.algorithm.continues(config):
            # Back in the same run: keep our discriminator unless the server says to restore a saved one.
            await self._restore(welcome)
            return
        shard = self.data.take(config, welcome.shard_index, tuple(welcome.spec.class_names) or None)
        self.run_state.shard_index = shard.index
        self.worker_id = welcome.worker_id
        self.swap_timeout = welcome.swap_timeout_ms / 1000 or self.swap_timeout
        if name not in ALGORITHMS:
            raise ServerGone(f"the server runs {welcome.spec.algorithm!r}, which this worker does not know")
        self.algorithm = ALGORITHMS[name](self, config, shard)
        self._traffic = self.algorithm.traffic
        log.info("joined run %s as %s: %s, b=%d, L=%d", run.run_id or "(no id)", self.worker_id,
                 config.model.architecture, config.batch_size, config.disc_steps)
        await self._restore(welcome)

    async def _restore(self, welcome: pb.Welcome) -> None:
        """Set up what the welcome says; the algorithm sets up its own part (saved state, ...)."""
        self.worker_id = welcome.worker_id
        self.swap_timeout = welcome.swap_timeout_ms / 1000 or self.swap_timeout
        self.identity = welcome.identity or self.identity
        await self.algorithm.welcome(welcome)
