"""Provisioning: a run's certificate authority and the certificates of its server and workers.

One directory holds a run's PKI, the way federated-learning users know from startup kits:

    DIR/ca.crt, DIR/ca.key                 the run's CA (keep ca.key off the machines that train)
    DIR/NAME/tls.crt, tls.key, ca.crt      one identity: what `--tls-cert/--tls-key/--tls-ca` take

A certificate's identity is its name: the common name, repeated as the first subject alternative
name (SAN). Its role (server or worker) is the organizational unit, so the server's own certificate
cannot be used to join as a worker. Every certificate may act as TLS server and client: workers
serve the Peer service and dial their peers and the server; the server's certificate also lets
health checks inside its container authenticate.

Keys are ECDSA P-256 (small, fast handshakes); certificates are built with the `cryptography`
package, never by shelling out to openssl.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

ROLE_SERVER = "mdgan-server"
ROLE_WORKER = "mdgan-worker"
ROLES = {"server": ROLE_SERVER, "worker": ROLE_WORKER}
CA_NAME = "mdgan run CA"
# Names a server certificate always carries, so loopback clients and health checks can verify it.
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
NAME_PATTERN = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,126}[A-Za-z0-9])?$")


class PKIError(ValueError):
    """A provisioning request that cannot be met (bad name, missing CA, existing files)."""


def _write(path: str, data: bytes, private: bool = False) -> None:
    """Atomically: a reader never sees half a key; keys are readable by their owner only."""
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _key_pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _general_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def check_name(name: str) -> str:
    if not NAME_PATTERN.match(name or ""):
        raise PKIError(f"{name!r} is not a usable identity: letters, digits, '.', '_' and '-', at most 128 "
                       "characters, starting and ending with a letter or digit")
    return name


def ca_paths(directory: str) -> tuple[str, str]:
    return os.path.join(directory, "ca.crt"), os.path.join(directory, "ca.key")


def identity_paths(directory: str, name: str) -> dict[str, str]:
    folder = os.path.join(directory, name)
    return {"ca": os.path.join(folder, "ca.crt"), "cert": os.path.join(folder, "tls.crt"),
            "key": os.path.join(folder, "tls.key")}


def init_ca(directory: str, *, days: int = 365, common_name: str = CA_NAME, overwrite: bool = False) -> str:
    """Create DIR/ca.crt and DIR/ca.key; returns the certificate's path."""
    cert_path, key_path = ca_paths(directory)
    if os.path.exists(cert_path) and not overwrite:
        raise PKIError(f"{cert_path} exists: a CA is there already (issue certificates with it, or pick another DIR)")
    os.makedirs(directory, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    _write(key_path, _key_pem(key), private=True)
    _write(cert_path, _cert_pem(cert))
    return cert_path


def issue(directory: str, name: str, role: str = "worker", *, sans: list[str] | tuple[str, ...] = (),
          days: int = 365, overwrite: bool = False) -> dict[str, str]:
    """A key and a certificate for identity `name`, signed by DIR's CA, in DIR/NAME/.

    SANs: `name` first, then (server role) localhost and the loopback addresses, then `sans`.
    Returns the paths {"ca", "cert", "key"}.
    """
    check_name(name)
    if role not in ROLES:
        raise PKIError(f"role must be one of {sorted(ROLES)}, got {role!r}")
    ca_cert_path, ca_key_path = ca_paths(directory)
    if not (os.path.exists(ca_cert_path) and os.path.exists(ca_key_path)):
        raise PKIError(f"no CA in {directory}: run `mdgan certs init {directory}` first")
    paths = identity_paths(directory, name)
    if os.path.exists(paths["cert"]) and not overwrite:
        raise PKIError(f"{paths['cert']} exists (give another name, or --overwrite to replace it)")
    with open(ca_cert_path, "rb") as fh:
        ca_pem = fh.read()
    with open(ca_key_path, "rb") as fh:
        ca_key = serialization.load_pem_private_key(fh.read(), password=None)
    ca_cert = x509.load_pem_x509_certificate(ca_pem)

    names = [name, *(LOOPBACK_NAMES if role == "server" else ()), *sans]
    names = list(dict.fromkeys(n for n in names if n))  # in order, without repeats
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, ROLES[role]),
                         x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName([_general_name(n) for n in names]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.KeyUsage(digital_signature=True, key_agreement=True, key_cert_sign=False,
                                         crl_sign=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    os.makedirs(os.path.dirname(paths["cert"]), exist_ok=True)
    _write(paths["key"], _key_pem(key), private=True)
    _write(paths["cert"], _cert_pem(cert))
    _write(paths["ca"], ca_pem)
    return paths


def provision_run(directory: str, workers: list[str], server: str = "mdgan-server",
                  server_sans: list[str] | tuple[str, ...] = ()) -> dict[str, dict[str, str]]:
    """A throwaway PKI for one run: a CA, the server's certificate and one per worker."""
    init_ca(directory, overwrite=True)
    issued = {server: issue(directory, server, "server", sans=server_sans, overwrite=True)}
    for name in workers:
        issued[name] = issue(directory, name, "worker", overwrite=True)
    return issued


def check_identity(directory: str, name: str, role: str, must_name: str | None = None,
                   now: datetime.datetime | None = None) -> str | None:
    """Why DIR/NAME's certificate cannot serve as `name` in this run, or None when it can: it must be
    signed by DIR's CA, carry `name` and role `role`, be valid now, and be valid for `must_name` (the
    host it is reached at). Each reason says how to fix it."""
    paths = identity_paths(directory, name)
    ca_cert_path = ca_paths(directory)[0]
    reissue = f"`mdgan certs issue {directory} {name}{' --server' if role == 'server' else ''}" + \
              (f" --san {must_name}" if must_name and must_name != name else "") + " --overwrite`"
    try:
        with open(paths["cert"], "rb") as fh:
            cert = x509.load_pem_x509_certificate(fh.read())
        with open(ca_cert_path, "rb") as fh:
            ca = x509.load_pem_x509_certificate(fh.read())
    except FileNotFoundError as exc:
        return f"{exc.filename} is missing: run `mdgan certs init {directory}` and {reissue}"
    except ValueError as exc:
        return f"{paths['cert']} is not a PEM certificate ({exc}): issue it again with {reissue}"
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, Exception) as exc:  # InvalidSignature, or another issuer
        return (f"{paths['cert']} was not issued by the CA in {directory} ({type(exc).__name__}): a certificate of "
                f"another CA is refused by every member of this run; issue it again with {reissue}")
    cn, sans, cert_role = certificate_names(cert.public_bytes(serialization.Encoding.PEM))
    if cn != name:
        return f"{paths['cert']} is {cn!r}'s certificate, not {name!r}'s: issue it again with {reissue}"
    if cert_role != ROLES[role]:
        return f"{paths['cert']} is a {cert_role} certificate, not a {ROLES[role]} one: issue it again with {reissue}"
    now = now or datetime.datetime.now(datetime.timezone.utc)
    if now < cert.not_valid_before_utc:
        return (f"{paths['cert']} is not valid before {cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC and this "
                f"machine's clock says {now:%Y-%m-%d %H:%M} UTC: set the clock right (NTP) on the machine that "
                f"issued it or on this one")
    if now > cert.not_valid_after_utc:
        return f"{paths['cert']} expired on {cert.not_valid_after_utc:%Y-%m-%d}: issue it again with {reissue}"
    if must_name and must_name not in sans:
        return (f"{paths['cert']} is valid for {', '.join(sans)}, not for {must_name!r}, the name others reach it "
                f"at: issue it again with {reissue}")
    return None


def check_credentials(ca_pem: bytes, cert_pem: bytes, now: datetime.datetime | None = None) -> str | None:
    """Why a process's own certificate cannot work with its CA file (None: it can): not issued by that
    CA (a site given another PKI's ca.crt, or its certificate from another PKI), not valid yet (this
    machine's clock is behind the issuer's), or expired. Said before anything dials or listens, since
    the TLS handshake would only say "unable to get local issuer certificate" or "Socket closed"."""
    try:
        chain = x509.load_pem_x509_certificates(cert_pem)
        authorities = x509.load_pem_x509_certificates(ca_pem)
    except ValueError as exc:
        return f"not a PEM certificate ({exc})"
    cert = chain[0]

    def issued_by(authority: x509.Certificate) -> bool:
        try:
            cert.verify_directly_issued_by(authority)
            return True
        except Exception:  # InvalidSignature, another issuer name, another key type
            return False

    # (a certificate that comes with its intermediates is left to the handshake to check)
    if len(chain) == 1 and not any(issued_by(a) for a in authorities):
        return ("the certificate was not issued by the CA in the --tls-ca file: this machine holds files of two "
                "different PKIs; use one kit's tls/ folder whole (its ca.crt, tls.crt and tls.key), made from the "
                "run's PKI")
    now = now or datetime.datetime.now(datetime.timezone.utc)
    if now < cert.not_valid_before_utc:
        return (f"the certificate is not valid before {cert.not_valid_before_utc:%Y-%m-%d %H:%M:%S} UTC, and this "
                f"machine's clock says {now:%Y-%m-%d %H:%M:%S} UTC: set its clock right (NTP)")
    if now > cert.not_valid_after_utc:
        return (f"the certificate expired on {cert.not_valid_after_utc:%Y-%m-%d}: issue it again (`mdgan certs "
                f"issue ... --overwrite`, or a new kit) and restart")
    return None


def explain_handshake(details: str) -> str | None:
    """What a failed TLS handshake's gRPC details mean for an operator (None: not a TLS failure)."""
    known = (
        ("unable to get local issuer certificate",
         "the peer's certificate is not signed by this process's CA (--tls-ca): both ends must hold files of the "
         "run's one PKI (a kit's tls/ folder)"),
        ("certificate is not yet valid",
         "the peer's certificate is not valid yet: one of the two machines' clocks is wrong (set it with NTP)"),
        ("certificate has expired", "the peer's certificate has expired: issue it again and restart that peer"),
        ("Hostname Verification Check failed",
         "the peer's certificate does not carry the name it was dialled by: issue it with that name (--san), or "
         "give the name it carries (--tls-server-name)"),
        ("Socket closed",
         "the peer closed the connection during the handshake: it may not trust this process's certificate (another "
         "PKI's, or not valid by its clock), or it is not a TLS endpoint"),
    )
    if "handshake" not in details.lower() and "Socket closed" not in details and "Verification" not in details:
        return None
    for marker, meaning in known:
        if marker in details:
            return meaning
    return "the TLS handshake failed"


# -- reading certificates (what the services learn about a peer) ------------------------------------

def certificate_names(pem: bytes) -> tuple[str | None, list[str], str | None]:
    """(common name, SANs as text, role) of a PEM certificate."""
    cert = x509.load_pem_x509_certificate(pem)
    cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    ou = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    try:
        ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        sans = [*ext.get_values_for_type(x509.DNSName), *(str(ip) for ip in ext.get_values_for_type(x509.IPAddress))]
    except x509.ExtensionNotFound:
        sans = []
    return (str(cn[0].value) if cn else None, sans, str(ou[0].value) if ou else None)


def identity_of(pem: bytes) -> tuple[str | None, str | None]:
    """(identity, role) of a certificate: its common name when it is also a SAN (as `mdgan certs`
    and cert-manager write them), else its first DNS SAN, else its common name."""
    cn, sans, role = certificate_names(pem)
    if cn and (cn in sans or not sans):
        return cn, role
    return (sans[0] if sans else cn), role
