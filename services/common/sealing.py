"""End-to-end sealing of a discriminator relayed between two sites, so that the relay can neither read
nor alter it.

The key is agreed from the two sites' certificate keys (static ECDH on their P-256 keys, as `mdgan
certs` issues them) and a fresh salt per push (HKDF-SHA256), so that only the sender and the receiver
can compute it, and each push has a key of its own. Every chunk is sealed with AES-256-GCM; its
associated data binds it to the sender, the receiver, the round, whether it is a copy, its index and
whether it is the last: a chunk moved, dropped, repeated, altered, or taken from another round or pair
fails to open. The receiver takes the sender's certificate from the push, checks that the run's CA
issued it, and knows the sender by the name in it: only the holder of that certificate's key could
have sealed what opens."""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from services.common import pki

PROTOCOL = b"mdgan relayed discriminator v1"
SALT_BYTES = 32


class SealError(ValueError):
    """A sealed push that cannot be opened (altered, replayed into another round, from a certificate the
    run's CA did not issue), or credentials that cannot seal (no EC key)."""


@dataclass(frozen=True)
class Envelope:
    """What the relay sees of a push: who it goes to and from, the round, and the salt; the chunks are
    sealed."""

    sender: str
    receiver: str
    round: int
    copy: bool
    salt: bytes


def _context(envelope: Envelope) -> bytes:
    parts = [PROTOCOL, envelope.sender.encode(), envelope.receiver.encode(),
             struct.pack(">Q?", envelope.round, envelope.copy)]
    return b"".join(struct.pack(">I", len(p)) + p for p in parts)


def _ec_private(key_pem: bytes) -> ec.EllipticCurvePrivateKey:
    key = serialization.load_pem_private_key(key_pem, password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise SealError("relayed swaps agree their keys from the sites' certificate keys, which must be EC keys "
                        "(as `mdgan certs` issues them); this site's key is not")
    return key


def _ec_public(cert_pem: bytes) -> ec.EllipticCurvePublicKey:
    try:
        key = x509.load_pem_x509_certificates(cert_pem)[0].public_key()
    except ValueError as exc:
        raise SealError(f"not a PEM certificate ({exc})") from None
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise SealError("the other site's certificate key is not an EC key: relayed swaps need EC keys")
    return key


def _aead(own_key_pem: bytes, other_cert_pem: bytes, envelope: Envelope) -> AESGCM:
    own, other = _ec_private(own_key_pem), _ec_public(other_cert_pem)
    if own.curve.name != other.curve.name:
        raise SealError(f"the two sites' keys are on different curves ({own.curve.name}, {other.curve.name})")
    shared = own.exchange(ec.ECDH(), other)
    key = HKDF(hashes.SHA256(), 32, salt=envelope.salt, info=_context(envelope)).derive(shared)
    return AESGCM(key)


def _nonce_and_data(envelope: Envelope, index: int, last: bool) -> tuple[bytes, bytes]:
    return struct.pack(">4xQ", index), _context(envelope) + struct.pack(">Q?", index, last)


def new_envelope(sender: str, receiver: str, swap_round: int, copy: bool) -> Envelope:
    return Envelope(sender, receiver, swap_round, copy, os.urandom(SALT_BYTES))


def seal(chunks: list[bytes], own_key_pem: bytes, receiver_cert_pem: bytes, envelope: Envelope) -> list[bytes]:
    """Each chunk sealed for the receiver whose certificate is `receiver_cert_pem`."""
    aead = _aead(own_key_pem, receiver_cert_pem, envelope)
    sealed = []
    for i, chunk in enumerate(chunks):
        nonce, data = _nonce_and_data(envelope, i, i == len(chunks) - 1)
        sealed.append(aead.encrypt(nonce, chunk, data))
    return sealed


def sender_identity(ca_pem: bytes, sender_cert_pem: bytes) -> str:
    """The name in a sender's certificate, once the run's CA is known to have issued it."""
    try:
        cert = x509.load_pem_x509_certificates(sender_cert_pem)[0]
        authorities = x509.load_pem_x509_certificates(ca_pem)
    except ValueError as exc:
        raise SealError(f"the sender's certificate is not PEM ({exc})") from None
    for authority in authorities:
        try:
            cert.verify_directly_issued_by(authority)
            break
        except Exception:  # InvalidSignature, another issuer, another key type
            continue
    else:
        raise SealError("the sender's certificate was not issued by this run's CA")
    problem = pki.check_credentials(ca_pem, sender_cert_pem)
    if problem:
        raise SealError(f"the sender's certificate: {problem}")
    identity, _ = pki.identity_of(sender_cert_pem)
    if not identity:
        raise SealError("the sender's certificate names no identity")
    return identity


class Opener:
    """Opens a push's chunks in order, as they come; the last must say it is the last."""

    def __init__(self, own_key_pem: bytes, sender_cert_pem: bytes, envelope: Envelope):
        self.envelope = envelope
        self._aead = _aead(own_key_pem, sender_cert_pem, envelope)
        self.index = 0
        self.finished = False

    def open(self, sealed: bytes, last: bool) -> bytes:
        if self.finished:
            raise SealError("a sealed chunk after the last one")
        nonce, data = _nonce_and_data(self.envelope, self.index, last)
        try:
            chunk = self._aead.decrypt(nonce, sealed, data)
        except InvalidTag:
            raise SealError(f"sealed chunk {self.index} of round {self.envelope.round} from "
                            f"{self.envelope.sender!r} does not open: altered, moved or replayed on the way") from None
        self.index += 1
        self.finished = last
        return chunk
