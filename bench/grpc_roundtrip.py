"""The cost of the wire alone: one Batches message (X_g and X_d, 10x784 float32 each) down and one
Feedback (10x784) up over a grpc.aio stream between two processes, without any training.

    python bench/grpc_roundtrip.py                   # default channel options (services/common/rpc.py)
    python bench/grpc_roundtrip.py '[["grpc.http2.write_buffer_size", 1048576]]'

Prints CPU microseconds per round trip of each side and wall microseconds per round trip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grpc  # noqa: E402
import torch  # noqa: E402

from services.common import codec, rpc  # noqa: E402
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


async def serve(options) -> None:
    server = grpc.aio.server(options=rpc.options() + options)
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(Echo(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


async def client(port: int, options) -> tuple[float, float]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=rpc.options() + options) as channel:
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
    options = [tuple(o) for o in json.loads(sys.argv[2] if sys.argv[1:2] == ["serve"] else (sys.argv[1:2] or ["[]"])[0])]
    run = rpc.run
    if sys.argv[1:2] == ["serve"]:
        run(serve(options))
        return 0
    server = subprocess.Popen([sys.executable, __file__, "serve", json.dumps(options)], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        before = process_cpu(server.pid)
        cpu, wall = run(client(port, options))
        server_cpu = process_cpu(server.pid) - before
    finally:
        server.kill()
    print(f"options {options or 'default'}: client {1e6 * cpu / ROUND_TRIPS:.0f} us CPU per round trip, server "
          f"{1e6 * server_cpu / ROUND_TRIPS:.0f} us (warm-up included), {1e6 * wall / ROUND_TRIPS:.0f} us wall")
    return 0


if __name__ == "__main__":
    sys.exit(main())
