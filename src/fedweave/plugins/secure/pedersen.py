"""Pedersen commitments in a Schnorr group: g^a · h^b mod P in the subgroup of prime order Q.

Pedersen, "Non-Interactive and Information-Theoretic Secure Verifiable Secret Sharing",
CRYPTO 1991. P is a 2048-bit prime and Q a 256-bit prime dividing P − 1 (a discrete
logarithm there costs about 2^112: NIST SP 800-57's figure for 2048-bit groups). A
commitment C = g^a h^b hides a perfectly (h^b is uniform in the subgroup whatever a is),
and binds it as long as nobody knows log_g h: g and h are derived from fixed strings by
SHA-256 (nothing up the sleeve), so nobody does.

Q is the first prime above SHA-256("fedweave pedersen q") with its top bit set, P the first
prime k·Q + 1 above the 2048-bit SHA-256 expansion of "fedweave pedersen p" (both tested
for primality in ``tests/plugins/secure/test_pedersen.py``). Exponentiations of the fixed
bases g and h use tables of base^(d·256^i): 32 products each, about a tenth of a ``pow``.
"""

from __future__ import annotations

import functools
import hashlib

P = int(
    "8063f4defb05ce9e0aa2bd184ab4a67ea760788af521f7c55f320659148b7137a619804a28b13ecfd803720747dad4bf"
    "be8783791ec524288d7b687bee71695535e7c08d14a43f8fd7a6fa0aa0183d7e7c577c31b4e228795575f39e31249cee"
    "d139538deb668e5c26d84710a60571f2a70cd7ff021104822677dc218f4331c97c1a63b6c086c9791f5f5575a9375bc0"
    "f2060dffe09251edb6627a1e98ecb3837634ee68fbb4eff37b4e3fae0b2714466e1f7263e25ae5487c839745cd61a257"
    "9eb5496a04eba118e8b8ea3fff2a466c0fff28c7fa3ad2c0f7311c9b512223339e65738dd6449c228214951f613627ce"
    "59560acec45f22f1814a7f5e18551777",
    16,
)
Q = int(
    "d1e25e18e85e71c525ce04c162b453110b104d9a65b9fd7bff75d9b27e9b1a03",
    16,
)
ELEMENT_BYTES = 256
"""A group element, big-endian."""
SCALAR_BYTES = 32
"""An exponent (an element of GF(Q)), big-endian."""
WINDOW = 8


def _base(label: bytes) -> int:
    """An element of order Q from ``label``: its SHA-256 expansion mod P, raised to (P − 1) / Q."""
    wide = b"".join(hashlib.sha256(label + bytes([i])).digest() for i in range(9))
    base = pow(int.from_bytes(wide, "big") % P, (P - 1) // Q, P)
    if base == 1:  # probability about 2^-256; the derivation is fixed, and tested
        raise ValueError(f"{label!r} derives the identity")
    return base


@functools.cache
def _table(label: bytes) -> tuple[tuple[int, ...], ...]:
    """base^(d · 256^i) mod P for i < 32 windows, d < 256."""
    rows, power = [], _base(label)
    for _ in range(-(-Q.bit_length() // WINDOW)):
        row = [1]
        for _ in range(1, 1 << WINDOW):
            row.append(row[-1] * power % P)
        rows.append(tuple(row))
        power = row[-1] * power % P
    return tuple(rows)


def generators() -> tuple[int, int]:
    """g and h."""
    return _table(b"fedweave pedersen g")[0][1], _table(b"fedweave pedersen h")[0][1]


def _fixed(label: bytes, exponent: int) -> int:
    out = 1
    for row in _table(label):
        if exponent == 0:
            break
        digit = exponent & ((1 << WINDOW) - 1)
        if digit:
            out = out * row[digit] % P
        exponent >>= WINDOW
    return out


def commit(value: int, blinding: int) -> int:
    """g^value · h^blinding mod P (``value`` and ``blinding`` in [0, Q))."""
    return _fixed(b"fedweave pedersen g", value) * _fixed(b"fedweave pedersen h", blinding) % P


def evaluate(commitments: list[int], x: int) -> int:
    """Π_j C_j^(x^j) mod P, by Horner's rule in the exponent: the commitment of f(x), f'(x) when
    C_j commits the coefficients of x^j of f and f'."""
    out = 1
    for c in reversed(commitments):
        out = pow(out, x, P) * c % P
    return out


def to_element(data: bytes) -> int:
    """A group element from its bytes; ValueError unless in [1, P). (Membership in the subgroup is not
    checked: a dealer's commitments outside it only fail that dealer's own shares.)"""
    value = int.from_bytes(data, "big")
    if not 1 <= value < P:
        raise ValueError("a commitment is not an element of the group")
    return value
