"""Mutual TLS for every gRPC endpoint, and who is on the other end of a call.

Both services take `--tls-ca`, `--tls-cert`, `--tls-key` (or MDGAN_TLS_CA, ...): the run's CA and
this process's own certificate and key (see services/common/pki.py and `mdgan certs`). Servers
require a client certificate signed by that CA; clients verify the server's certificate against it
and present their own. Plaintext needs an explicit `--insecure`, logged as a warning: then an
identity is only what a worker claims to be, and nothing is authenticated.
"""

from __future__ import annotations

import argparse
import functools
import logging
from dataclasses import dataclass

import grpc

from mdgan.config import ConfigError
from services.common import pki

log = logging.getLogger("mdgan.tls")


@dataclass(frozen=True)
class TLSConfig:
    """This process's credentials: the CA it trusts, its certificate chain and private key (PEM)."""

    ca: bytes
    cert: bytes
    key: bytes
    identity: str
    role: str | None

    @classmethod
    def load(cls, ca_path: str, cert_path: str, key_path: str) -> "TLSConfig":
        blobs = []
        for flag, path in (("--tls-ca", ca_path), ("--tls-cert", cert_path), ("--tls-key", key_path)):
            try:
                with open(path, "rb") as fh:
                    blobs.append(fh.read())
            except OSError as exc:
                raise ConfigError(f"{flag} {path}: {exc.strerror}") from None
        try:
            identity, role = pki.identity_of(blobs[1])
        except ValueError as exc:
            raise ConfigError(f"--tls-cert {cert_path}: not a PEM certificate ({exc})") from None
        if not identity:
            raise ConfigError(f"--tls-cert {cert_path}: the certificate names no identity (no CN, no SAN)")
        problem = pki.check_credentials(blobs[0], blobs[1])
        if problem:
            raise ConfigError(f"--tls-cert {cert_path} with --tls-ca {ca_path}: {problem}")
        return cls(ca=blobs[0], cert=blobs[1], key=blobs[2], identity=identity, role=role)

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)


def add_tls_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("transport security (mutual TLS; see `mdgan certs`)")
    g.add_argument("--tls-ca", default=None, help="PEM file of the run's CA: peers must present certificates it signed")
    g.add_argument("--tls-cert", default=None, help="PEM file of this process's certificate")
    g.add_argument("--tls-key", default=None, help="PEM file of this process's private key")
    g.add_argument("--insecure", action="store_true",
                   help="plaintext gRPC, no authentication (identities are whatever workers claim): for trusted "
                        "networks and debugging only")


def from_args(args: argparse.Namespace, role: str) -> TLSConfig | None:
    """The process's TLS configuration, or None with --insecure (after a warning)."""
    given = [p for p in (args.tls_ca, args.tls_cert, args.tls_key) if p]
    if args.insecure:
        if given:
            log.warning("--insecure: the --tls-* settings are ignored")
        log.warning("--insecure: %s serves and dials in plaintext; anyone who reaches its ports can join, push "
                    "discriminators and read the traffic", role)
        return None
    if len(given) != 3:
        raise ConfigError("mutual TLS needs --tls-ca, --tls-cert and --tls-key (MDGAN_TLS_CA, MDGAN_TLS_CERT, "
                          "MDGAN_TLS_KEY; make them with `mdgan certs`), or --insecure for plaintext")
    config = TLSConfig.load(args.tls_ca, args.tls_cert, args.tls_key)
    log.info("mutual TLS as %r (role %s)", config.identity, config.role or "unspecified")
    return config


def add_port(server: grpc.aio.Server, address: str, tls: TLSConfig | None) -> int:
    """Bind `address` with mTLS (or plaintext when tls is None); returns the bound port."""
    try:
        return server.add_insecure_port(address) if tls is None else server.add_secure_port(
            address, tls.server_credentials())
    except RuntimeError:  # gRPC says only that binding failed
        raise ConfigError(f"--listen {address}: cannot listen there (the port is taken, or the host is not an "
                          f"address of this machine)") from None


def channel(address: str, tls: TLSConfig | None, options: list | None = None,
            server_name: str | None = None) -> grpc.aio.Channel:
    """A client channel. `server_name`: the identity the server's certificate must carry, when it
    is not the host name in `address` (a peer worker is verified as the identity the server named)."""
    options = list(options or [])
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=options)


@functools.lru_cache(maxsize=256)
def _identity_of_pem(pem: bytes) -> tuple[str | None, str | None]:
    try:
        return pki.identity_of(pem)
    except ValueError:
        return None, None


def peer_certificate(context: grpc.aio.ServicerContext) -> tuple[str | None, str | None]:
    """(identity, role) of the verified client certificate of this call; (None, None) without one."""
    auth = context.auth_context() or {}
    pem = (auth.get("x509_pem_cert") or [None])[0]
    if not pem:
        return None, None
    return _identity_of_pem(pem)


def peer_certificate_pem(context: grpc.aio.ServicerContext) -> bytes | None:
    """The verified client certificate of this call, PEM (None without one)."""
    pem = ((context.auth_context() or {}).get("x509_pem_cert") or [None])[0]
    return pem or None


def peer_identity(context: grpc.aio.ServicerContext) -> str | None:
    """The SAN/CN of the client certificate under mTLS (gRPC has verified it against the CA)."""
    return peer_certificate(context)[0]


def is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]") if ":" in address else address
    return host in pki.LOOPBACK_NAMES or host.startswith("127.")
