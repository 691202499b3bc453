"""What a worker's algorithm may use of the connection that runs it (services/worker/node.py's
WorkerNode provides it): the worker side's counterpart of services/server/context.py.

An algorithm module (services/worker/algorithms/x.py) is given this, never the node's other parts;
tests/test_layers.py checks that the algorithms reach nothing else and that WorkerNode has all of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import grpc

    from services.common.telemetry import Telemetry
    from services.common.tls import TLSConfig
    from services.common.proto import coordinator_pb2 as pb
    from services.worker.node import SitePolicy
    from services.worker.peer import PeerInbox
    from services.worker.run_state import RunState


class WorkerContext(Protocol):
    worker_id: str  # the id the server gave this worker (worker-K)
    identity: str  # its certificate's name (what peers check when it pushes a discriminator)
    telemetry: Telemetry  # every Prometheus metric of this process
    tls: TLSConfig | None  # its certificate and the CA, for peer-to-peer channels (None: --insecure)
    swap_timeout: float  # the server's swap deadline, from the welcome (s)
    run_state: RunState  # the run it is in and what it keeps of it: checkpoints, privacy ledgers (run_state.py)
    policy: SitePolicy  # the site's own limits (--swap-check, --dp-max-epsilon) and emulations (--attack, ...)
    server_channel: grpc.aio.Channel | None  # the session's channel to the server (relayed pushes go over it)

    async def write(self, call, message: pb.WorkerMessage) -> None:
        """Send one message to the server on the stream `call` (counted on the wire counters)."""

    def fail(self, where: str, exc: BaseException) -> None:
        """This worker's own exception in a task of its own (`where`: what it was doing): logged, told to
        the server as a Fault, and the worker's session ends; the worker exits 1."""


class PeerHost(Protocol):
    """What the Peer service (services/worker/peer.py) may use of the worker that serves it;
    tests/test_layers.py checks that it reaches nothing else."""

    telemetry: Telemetry
    tls: TLSConfig | None  # None (--insecure): a pusher is who its header says
    swap_timeout: float  # how long a push waits for the round's order

    def peer_inbox(self) -> PeerInbox | None:
        """Where pushed discriminators go: the run's MD-GAN worker (None: not in an MD-GAN run)."""

    def fail(self, where: str, exc: BaseException) -> None:
        """The worker's own error while receiving: it ends its session (WorkerContext.fail)."""
