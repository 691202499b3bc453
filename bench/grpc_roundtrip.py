"""The cost of the wire alone: one Batches message (X_g and X_d, 10x784 float32 each) down and one
Feedback (10x784) up over a grpc.aio stream between two processes, without any training.

    python bench/grpc_roundtrip.py                   # default channel options (services/common/rpc.py)
    python bench/grpc_roundtrip.py '[["grpc.http2.write_buffer_size", 1048576]]'
    python bench/grpc_roundtrip.py --tls             # mutual TLS, as the services run by default
    GRPC_EXPERIMENTS=-event_engine_client,-event_engine_listener python bench/grpc_roundtrip.py --tls

Prints CPU microseconds per round trip of each side and wall microseconds per round trip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import services  # noqa: E402,F401  (its process-wide gRPC settings, before grpc is imported)
import grpc  # noqa: E402
import torch  # noqa: E402

from services.common import codec, pki, rpc, tls  # noqa: E402
from services.common.proto import coordinator_pb2 as pb  # noqa: E402
from services.common.proto import coordinator_pb2_grpc  # noqa: E402

ROUND_TRIPS, WARM_UP = 1000, 50


class Echo(coordinator_pb2_grpc.CoordinatorServicer):
    async def Train(self, request_iterator, context):
        x = torch.randn(10, 784)
        message = pb.ServerMessage(batches=pb.Batches(iteration=1, generated=codec.encode_tensor(x),
                                                      discriminated=codec.encode_tensor(x)))
        while True:
            await context.write(message)
            if await context.read() is grpc.aio.EOF:
                return


def credentials(directory: str | None, name: str):
    """The TLSConfig of `name` from a throwaway PKI in `directory` (None: plaintext)."""
    if directory is None:
        return None
    paths = pki.identity_paths(directory, name)
    return tls.TLSConfig.load(paths["ca"], paths["cert"], paths["key"])


async def serve(options, pki_dir) -> None:
    server = grpc.aio.server(options=rpc.options() + options)
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(Echo(), server)
    port = tls.add_port(server, "127.0.0.1:0", credentials(pki_dir, "mdgan-server"))
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


async def client(port: int, options, pki_dir) -> tuple[float, float]:
    async with tls.channel(f"127.0.0.1:{port}", credentials(pki_dir, "worker-0"), rpc.options() + options,
                           server_name="mdgan-server") as channel:
        call = coordinator_pb2_grpc.CoordinatorStub(channel).Train()
        feedback = pb.WorkerMessage(feedback=pb.Feedback(iteration=1, gradient=codec.encode_tensor(torch.randn(10, 784))))
        for i in range(ROUND_TRIPS + WARM_UP):
            if i == WARM_UP:
                cpu, wall = time.process_time(), time.perf_counter()
            await call.read()
            await call.write(feedback)
        return time.process_time() - cpu, time.perf_counter() - wall


def process_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    argv = sys.argv[1:]
    if argv[:1] == ["serve"]:  # the server process: serve OPTIONS [PKI_DIR]
        rpc.run(serve([tuple(o) for o in json.loads(argv[1])], argv[2] if len(argv) > 2 else None))
        return 0
    secure = "--tls" in argv
    argv = [a for a in argv if a != "--tls"]
    options = [tuple(o) for o in json.loads(argv[0] if argv else "[]")]
    with tempfile.TemporaryDirectory() as pki_dir:
        if secure:
            pki.provision_run(pki_dir, ["worker-0"])
        else:
            pki_dir = None
        server = subprocess.Popen([sys.executable, __file__, "serve", json.dumps(options), *([pki_dir] if pki_dir else [])],
                                  stdout=subprocess.PIPE, text=True)
        try:
            port = int(server.stdout.readline())
            before = process_cpu(server.pid)
            cpu, wall = rpc.run(client(port, options, pki_dir))
            server_cpu = process_cpu(server.pid) - before
        finally:
            server.kill()
    print(f"{'mTLS' if secure else 'plaintext'}, GRPC_EXPERIMENTS={os.environ.get('GRPC_EXPERIMENTS', '')!r}, "
          f"options {options or 'default'}: client {1e6 * cpu / ROUND_TRIPS:.0f} us CPU per round trip, server "
          f"{1e6 * server_cpu / ROUND_TRIPS:.0f} us (warm-up included), {1e6 * wall / ROUND_TRIPS:.0f} us wall")
    return 0


if __name__ == "__main__":
    sys.exit(main())
