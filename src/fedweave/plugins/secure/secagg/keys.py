"""SecAgg's keys: X25519 agreement, HKDF, the AES-128-GCM sealing of seed records and shares,
and the sizes of the protocol's secrets."""

from __future__ import annotations

import functools
import hmac
from types import SimpleNamespace
from typing import Any

from fedweave.plugins.secure import pedersen

KEY_BYTES = 32  # an X25519 public key
SECRET_BYTES = 16  # b_u, r_u, c_uv, s_uv: AES-128 keys, the 128-bit security of X25519
SHARE_BYTES = 2 * pedersen.SCALAR_BYTES  # a share of one secret: f(x) and its blinding f'(x), in GF(Q)
SEALED_SHARES = 2 * SHARE_BYTES + 16  # shares of r_u and b_u, and the GCM tag


@functools.cache
def crypto() -> Any:
    try:
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError:
        raise ImportError("plugin 'secagg' needs cryptography: pip install 'fedweave[privacy]'") from None
    return SimpleNamespace(
        InvalidTag=InvalidTag,
        PrivateKey=X25519PrivateKey,
        PublicKey=X25519PublicKey,
        Cipher=Cipher,
        AES128=algorithms.AES128,
        CTR=modes.CTR(bytes(16)),
        AESGCM=AESGCM,
    )


def hkdf(secret: bytes, *infos: bytes) -> list[bytes]:
    """HKDF-SHA256 (RFC 5869) without salt: one 32-byte output per ``info``, from one extraction."""
    prk = hmac.digest(bytes(32), secret, "sha256")
    return [hmac.digest(prk, info + b"\x01", "sha256") for info in infos]


def pair_info(rnd: int, u: int, v: int) -> bytes:
    """HKDF's context for a pair's keys: the round, the pair (in either order)."""
    return f"fedweave secagg pair|round {rnd}|{min(u, v)}|{max(u, v)}".encode()


def associated_data(what: str, rnd: int, sender: int, receiver: int) -> bytes:
    return f"fedweave secagg {what}|round {rnd}|{sender}->{receiver}".encode()


def sender_nonce(sender: int) -> bytes:
    # Every GCM key here (a pair's channel key, a record key) is fresh for the round and
    # encrypts once per sender.
    return sender.to_bytes(12, "big")


def open_sealed(key: bytes, nonce: bytes, sealed: bytes, aad: bytes, what: str) -> bytes:
    c = crypto()
    try:
        return c.AESGCM(key).decrypt(nonce, sealed, aad)
    except c.InvalidTag:
        raise ValueError(f"secagg: {what} does not authenticate") from None


@functools.lru_cache(maxsize=4096)
def public_key(raw: bytes) -> Any:
    """A parsed X25519 public key (public data: a simulation's clients parse each one once)."""
    return crypto().PublicKey.from_public_bytes(raw)
