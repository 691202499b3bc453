"""Ask a gRPC health service whether it is SERVING: exit 0 if so, 1 if not.

    mdgan-healthcheck localhost:50051 [--service mdgan.v1.Coordinator]

Over mutual TLS with the same --tls-ca/--tls-cert/--tls-key (or MDGAN_TLS_* variables) as the
service, so inside a container it uses the container's own credentials; --insecure (MDGAN_INSECURE)
for a plaintext service. Checking a service on loopback, the service's certificate must carry this
process's own identity (a container checking itself) unless --tls-server-name says otherwise.
For container HEALTHCHECKs and scripts (Kubernetes uses its native `grpc:` probe, or this command).
"""

from __future__ import annotations

import asyncio
import logging
import sys

from mdgan.config import ConfigError
from services.common.settings import add_version, EnvArgumentParser, dial_address, positive_seconds
from services.common import tls
from services.common.rpc import check_health


def main(argv: list[str] | None = None) -> int:
    parser = EnvArgumentParser(prog="mdgan-healthcheck", description=__doc__)
    add_version(parser, "mdgan-healthcheck")
    parser.add_argument("address", type=dial_address, help="host:port of an mdgan server or worker")
    parser.add_argument("--service", default="", help="service name to ask about (default: the whole server)")
    parser.add_argument("--timeout", type=positive_seconds, default=3.0, help="seconds before giving up")
    parser.add_argument("--tls-server-name", default=None,
                        help="the name the service's certificate must carry (default: the host in ADDRESS; on "
                             "loopback, the identity in --tls-cert)")
    tls.add_tls_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)  # no --insecure warning in every health probe
    try:
        credentials = tls.from_args(args, "mdgan-healthcheck")
    except ConfigError as exc:
        print(f"mdgan-healthcheck: {exc}", file=sys.stderr)
        return 2
    server_name = args.tls_server_name
    if credentials is not None and server_name is None and tls.is_loopback(args.address):
        server_name = credentials.identity
    serving = asyncio.run(check_health(args.address, args.service, args.timeout, credentials, server_name))
    print("SERVING" if serving else "NOT SERVING")
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
