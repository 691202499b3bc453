"""One module per algorithm on the server side; adding one = a module and a line here.

Each entry is the class that runs the algorithm's training loop in mdgan-server (check(args, run),
__init__(ServerContext), swap_round(), stop_requested, run(coordinator, stopping) -> (result, wall),
worker_to_worker_bytes(coordinator)); its `handle` is the algorithm's StreamHandle, the one the
Coordinator builds for every admitted worker (see docs/ALGORITHMS.md, "How to add an algorithm")."""

from __future__ import annotations

from services.server.algorithms.psgan import PSGANServer
from services.server.algorithms.flgan import FederatedServer
from services.server.algorithms.mdgan import MDGANServer
from services.server.algorithms.pwgan import PWGANServer

ALGORITHMS = {
    "mdgan": MDGANServer,
    "flgan": FederatedServer,
    "pwgan": PWGANServer,
    "psgan": PSGANServer,
}
