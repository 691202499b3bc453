"""Round trips over TCP between two machines of a consortium (bench/netns.py): a one-byte ping-pong,
TCP_NODELAY, after a warm-up; prints the median and the spread in milliseconds as JSON.

    python bench/rtt.py serve PORT                  # on one machine (in its namespace)
    python bench/rtt.py ping HOST PORT [--count N]  # on another: {"median_ms": ..., "min_ms": ..., "max_ms": ...}
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time


def serve(port: int) -> None:
    with socket.create_server(("0.0.0.0", port)) as listener:
        print("listening", flush=True)
        while True:
            conn, _ = listener.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with conn:
                while byte := conn.recv(1):
                    conn.sendall(byte)


def ping(host: str, port: int, count: int, warmup: int = 3) -> dict:
    with socket.create_connection((host, port), timeout=30) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        times = []
        for i in range(warmup + count):
            started = time.perf_counter()
            conn.sendall(b"x")
            if conn.recv(1) != b"x":
                raise RuntimeError("the echo closed")
            if i >= warmup:
                times.append((time.perf_counter() - started) * 1000)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "count": count}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve")
    s.add_argument("port", type=int)
    p = sub.add_parser("ping")
    p.add_argument("host")
    p.add_argument("port", type=int)
    p.add_argument("--count", type=int, default=30)
    args = parser.parse_args(argv)
    if args.command == "serve":
        serve(args.port)
    else:
        print(json.dumps(ping(args.host, args.port, args.count)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
