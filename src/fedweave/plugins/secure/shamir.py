"""Shamir secret sharing over the prime field of p = 2^521 − 1, in plain Python.

Shamir, "How to Share a Secret", CACM 1979. A secret s < p is the constant term of a
random polynomial f of degree t − 1; share i is (i, f(i)). Any t shares give s back by
Lagrange interpolation at 0; fewer reveal nothing about it. Secrets here are 32-byte
keys and seeds, far below p.
"""

from __future__ import annotations

import secrets

PRIME = 2**521 - 1

Share = tuple[int, int]


def split(secret: int, threshold: int, xs: list[int]) -> dict[int, Share]:
    """Shares of ``secret`` at the points ``xs`` (distinct, non-zero), any ``threshold`` of which recover it."""
    if not 0 <= secret < PRIME:
        raise ValueError("the secret must lie in [0, p)")
    if not 1 <= threshold <= len(xs):
        raise ValueError(f"threshold {threshold} needs between 1 and {len(xs)} shares")
    coefficients = [secret] + [secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    out = {}
    for x in xs:
        y = 0
        for c in reversed(coefficients):  # Horner
            y = (y * x + c) % PRIME
        out[x] = (x, y)
    return out


def combine(shares: list[Share]) -> int:
    """The secret behind ``shares`` (at least the threshold of them, distinct points)."""
    secret = 0
    for i, (xi, yi) in enumerate(shares):
        num, den = 1, 1
        for j, (xj, _) in enumerate(shares):
            if i != j:
                num = num * -xj % PRIME
                den = den * (xi - xj) % PRIME
        secret = (secret + yi * num * pow(den, -1, PRIME)) % PRIME
    return secret


def to_int(key: bytes) -> int:
    return int.from_bytes(key, "big")


def to_bytes(value: int, length: int = 32) -> bytes:
    return value.to_bytes(length, "big")
