"""A site's secret randomness: the DP noise and the Poisson sampling of one site, drawn from ChaCha20 keyed by a
secret the site makes itself, never from the run's seed (which the server hands every site).

A stream (`SecretStream`) is named ("dp-sgd/noise", "feedback/noise", ...) and indexed: draw `index` of a stream
is ChaCha20's keystream under the key HMAC-SHA256(secret, name) and the nonce `index`, turned into uniforms or
Gaussians on the CPU (the same numbers on any device). The index is the count of steps the site's ledger holds
(mdgan/privacy_ledger.py), so a draw is never made twice for a released step, whatever crashes, rejoins or
resumes come between.

`SiteSecret.fixed(value, site)` makes a site's secret from a number on purpose (`--dp-fixed-noise`), for research
and for tests that compare two runs bit for bit: the guarantee then holds only against those who do not know the
number.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
import threading
from dataclasses import dataclass

import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

KEY_BYTES = 32
_FIXED_DOMAIN = b"mdgan/dp-fixed-noise/v1"
_TWO_PI = 2.0 * math.pi


@dataclass(frozen=True, repr=False)
class SiteSecret:
    """The key a site's noise comes from (32 bytes) and whether it was fixed on purpose (--dp-fixed-noise).
    Its repr never shows the key."""

    key: bytes
    fixed: bool = False

    def __post_init__(self):
        if not isinstance(self.key, bytes) or len(self.key) != KEY_BYTES:
            raise ValueError(f"a site secret is {KEY_BYTES} bytes")

    @classmethod
    def new(cls) -> "SiteSecret":
        """A secret from the operating system's CSPRNG: nobody else can derive it."""
        return cls(secrets.token_bytes(KEY_BYTES))

    @classmethod
    def from_fixed(cls, value: int, site: int) -> "SiteSecret":
        """Site `site`'s secret made from `value` (--dp-fixed-noise): the same for every process given the same
        two numbers, so two runs draw the same noise; not derived from the run's seed."""
        return cls(hashlib.sha256(_FIXED_DOMAIN + f"/{int(value)}/{int(site)}".encode()).digest(), fixed=True)

    def stream(self, name: str) -> "SecretStream":
        return SecretStream(hmac.new(self.key, name.encode(), hashlib.sha256).digest())

    def __repr__(self) -> str:
        return f"SiteSecret(fixed={self.fixed})"


class SecretStream:
    """Draws of one named stream under a site's secret; draw `index` is always the same numbers."""

    def __init__(self, key: bytes):
        self._key = key

    def __repr__(self) -> str:
        return "SecretStream(...)"

    def uniform(self, index: int, n: int) -> torch.Tensor:
        """n uniforms in (0, 1), float64, 53 random bits each: (n,)."""
        if not 0 <= index < 2 ** 96:
            raise ValueError(f"draw index {index} out of range")
        if not n:
            return torch.zeros(0, dtype=torch.float64, device="cpu")  # (drawn on the CPU; the caller moves them)
        nonce = (0).to_bytes(4, "little") + int(index).to_bytes(12, "little")  # block counter 0, then the index
        keystream = _scratch(8 * n)  # (this thread's: read into a new tensor before the next draw)
        Cipher(algorithms.ChaCha20(self._key, nonce), mode=None).encryptor().update_into(_zeros(8 * n), keystream)
        words = torch.frombuffer(keystream, dtype=torch.int64, count=n)
        return (words & ((1 << 53) - 1)).to(torch.float64).add_(0.5).mul_(1.0 / (1 << 53))

    def normal(self, index: int, n: int, std: float = 1.0) -> torch.Tensor:
        """n draws of N(0, std^2), float64, by Box-Muller over `uniform`: (n,)."""
        pairs = (n + 1) // 2
        u = self.uniform(index, 2 * pairs)
        radius = u[:pairs].log_().mul_(-2.0).sqrt_()  # sqrt(-2 ln u1)
        angle = u[pairs:].mul_(_TWO_PI)
        out = torch.empty(2 * pairs, dtype=torch.float64, device=u.device)
        torch.mul(radius, torch.cos(angle), out=out[:pairs])
        torch.mul(radius, angle.sin_(), out=out[pairs:])
        return out[:n].mul_(std)


_ZEROS = bytearray()
_SCRATCH = threading.local()


def _scratch(n: int) -> memoryview:
    """This thread's buffer for a keystream of n bytes (kept: a fresh one costs its page faults every draw)."""
    buffer = getattr(_SCRATCH, "buffer", None)
    if buffer is None or len(buffer) < n:
        buffer = _SCRATCH.buffer = bytearray(n)
    return memoryview(buffer)[:n]


def _zeros(n: int) -> memoryview:
    """n zero bytes, the keystream's plaintext (one buffer, grown as needed and never written)."""
    global _ZEROS
    if len(_ZEROS) < n:
        _ZEROS = bytearray(n)
    return memoryview(_ZEROS)[:n]
