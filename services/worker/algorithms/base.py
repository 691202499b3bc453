"""What every algorithm module on the worker side implements, and the errors they end a session with."""

from __future__ import annotations

from typing import Awaitable, Callable, ClassVar

from mdgan.config import TrainingConfig
from mdgan.data import Shard
from services.common.wire import CONTROL
from services.worker.context import WorkerContext


class ServerGone(Exception):
    """The worker cannot go on with this server: it sent something invalid, or (StreamBroken) the
    stream broke and reconnecting did not bring it back within --server-timeout."""


class BudgetSpent(Exception):
    """This site's next step would spend more privacy than its --dp-max-epsilon: it leaves the run."""


class StreamBroken(ServerGone):
    """The stream ended without a stop (the server restarted, the network blipped): reconnect."""


class WorkerFailed(Exception):
    """This worker's own exception: told to the server as a Fault (one line), then the worker exits 1."""


class RunFailed(Exception):
    """The server stopped the run because it failed on its side: the worker exits 1 (its state kept,
    for a resume)."""


class WorkerAlgorithm:
    """One algorithm's part of a worker: built at the first welcome of a run (the spec's
    `algorithm` picks the class, services/worker/algorithms/__init__.py), it takes the server's
    messages of that algorithm only and answers them through `node.write(call, message)`; `node`
    is a WorkerContext (services/worker/context.py), all it may use of the connection. The node
    keeps the connection (join, welcome, heartbeats, reconnects, stop, rejections, faults).

    An exception a receiver raises (other than the errors above) is this worker's fault: the node
    reports it to the server and the worker exits. Work in a task of its own reports its exception
    through `node.fail(where, exc)`."""

    name: ClassVar[str] = ""
    trained_iteration = 0  # the last iteration this worker trained (sent in the join of a rejoin)

    def __init__(self, node: WorkerContext, config: TrainingConfig, shard: Shard):
        self.node = node
        self.config = config
        self.shard = shard

    def continues(self, config: TrainingConfig) -> bool:
        """Back in the same run after a reconnect: keep this object (and its model) for `config`."""
        return False

    async def welcome(self, welcome) -> None:
        """A (re)join was welcomed: set up what the welcome says (saved state to restore, ...)."""

    def final_discriminator(self) -> dict | None:
        """The weights of the discriminator this site holds when its run finishes (kept for the site's own
        audit); None: the algorithm's workers hold none of their own."""
        return None

    def peer_inbox(self):
        """Where the Peer service delivers pushed discriminators (services/worker/peer.py PeerInbox); None: the
        algorithm's workers take none."""
        return None

    def receivers(self) -> dict[str, Callable[[object, object], Awaitable[None]]]:
        """Body name (of ServerMessage's oneof) -> coroutine taking (call, that body)."""
        return {}

    @staticmethod
    def traffic(body: str | None, message) -> tuple[str, int]:
        """(telemetry kind, payload bytes) of a message of this algorithm, either way."""
        return CONTROL

    async def end_session(self) -> None:
        """The stream ended (stopped or broken): cancel background work, close peer channels."""
