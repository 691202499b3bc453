"""Ask a gRPC health service whether it is SERVING: exit 0 if so, 1 if not.

    python -m services.common.healthcheck localhost:50051 [--service mdgan.v1.Coordinator]

For container HEALTHCHECKs and scripts (Kubernetes uses its native `grpc:` probe instead).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from services.common.rpc import check_health


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mdgan-healthcheck", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("address", help="host:port of an mdgan server or worker")
    parser.add_argument("--service", default="", help="service name to ask about (default: the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds before giving up")
    args = parser.parse_args(argv)
    serving = asyncio.run(check_health(args.address, args.service, args.timeout))
    print("SERVING" if serving else "NOT SERVING")
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
