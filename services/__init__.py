"""The gRPC services (server, worker) over the mdgan library.

Runs before any module of the services imports grpc, which is why the one process-wide gRPC
setting lives here: gRPC core reads GRPC_EXPERIMENTS once, when it starts.

With gRPC's EventEngine (the default for clients and listeners since 1.6x), every message a
Python asyncio program reads or writes crosses three threads (an EventEngine I/O thread, the
completion-queue poller, the event loop). The older polling engine does the socket I/O on the
poller thread itself: one hand-off less per message. On loopback with mTLS and the MD-GAN
messages that costs 20-35% less CPU per round trip (`bench/grpc_roundtrip.py --tls`, with and
without the variable) and makes a whole `mdgan local` cluster use about 15% less CPU
(docs/PERFORMANCE.md). grpcio is pinned (pyproject.toml), so these experiment names are known to
exist; a user's own GRPC_EXPERIMENTS, even an empty one, is left as it is.
"""

import os

GRPC_EXPERIMENTS = "-event_engine_client,-event_engine_listener"
os.environ.setdefault("GRPC_EXPERIMENTS", GRPC_EXPERIMENTS)
