"""Shamir secret sharing of byte strings, vectorised with numpy over the field of p = 2^31 − 1.

Shamir, "How to Share a Secret", CACM 1979. A secret s < p is the constant term of a
random polynomial f of degree t − 1 over GF(p); share i is f(x_i) at a non-zero point
x_i. Any t shares give s back by Lagrange interpolation at 0; fewer reveal nothing
about it (every value of s is equally likely given t − 1 shares).

Byte strings (16-byte keys and seeds) are cut into 16-bit limbs and every limb is shared
with a polynomial of its own: sharing each coordinate of a vector independently keeps
the guarantee coordinate by coordinate, and so for the whole string. All the limbs of
all the secrets of one dealer are shared at once, as one matrix product in int64 (p <
2^31). Coefficients are drawn from the operating system's cryptographic source, uniform
in GF(p) by rejection.
"""

from __future__ import annotations

import functools
import os

import numpy as np

PRIME = (1 << 31) - 1
LIMB_BITS = 16


def to_limbs(secrets: list[bytes]) -> np.ndarray:
    """Equal-length byte strings as an int64 array of 16-bit limbs, one row each."""
    raw = np.frombuffer(b"".join(secrets), dtype=">u2").reshape(len(secrets), -1)
    return raw.astype(np.int64)


def from_limbs(limbs: np.ndarray) -> list[bytes]:
    """Undo :func:`to_limbs`; a limb outside [0, 2^16) (inconsistent shares) is a ValueError."""
    if limbs.size and (limbs.min() < 0 or limbs.max() >= 1 << LIMB_BITS):
        raise ValueError("the shares do not interpolate to a secret (they are inconsistent)")
    return [row.astype(">u2").tobytes() for row in np.atleast_2d(limbs)]


def _uniform(count: int) -> np.ndarray:
    """``count`` values uniform in [0, p) from os.urandom (31-bit draws, p itself rejected)."""
    out = np.frombuffer(os.urandom(4 * count), dtype=np.uint32).astype(np.int64) & PRIME
    bad = out == PRIME
    while bad.any():
        out[bad] = np.frombuffer(os.urandom(4 * int(bad.sum())), dtype=np.uint32).astype(np.int64) & PRIME
        bad = out == PRIME
    return out


def split(limbs: np.ndarray, threshold: int, xs: list[int]) -> np.ndarray:
    """Shares of every limb of ``limbs`` at the points ``xs``: shape ``(len(xs), *limbs.shape)``.

    Any ``threshold`` of the rows recover ``limbs`` (:func:`combine`). All polynomials are
    evaluated at once as V · C, V the Vandermonde matrix of the points mod p and C the
    coefficients, split into 16-bit halves so that every sum of products stays in int64.
    """
    if not 1 <= threshold <= len(xs):
        raise ValueError(f"threshold {threshold} needs between 1 and {len(xs)} shares")
    if len(set(xs)) != len(xs) or min(xs) < 1 or max(xs) >= PRIME or threshold > 1 << 15:
        raise ValueError("share points must be distinct and in [1, p), the threshold at most 2^15")
    secret = np.asarray(limbs, dtype=np.int64).reshape(1, -1)
    coefficients = np.concatenate([secret, _uniform((threshold - 1) * secret.size).reshape(threshold - 1, -1)])
    vandermonde = np.ones((len(xs), threshold), dtype=np.int64)
    points = np.asarray(xs, dtype=np.int64)
    for j in range(1, threshold):  # x^j mod p column by column: products of two values < 2^31
        vandermonde[:, j] = vandermonde[:, j - 1] * points % PRIME
    high = vandermonde @ (coefficients >> 16) % PRIME  # sums of < 2^15 terms below 2^31 · 2^16: in int64
    shares = ((high << 16) + vandermonde @ (coefficients & 0xFFFF)) % PRIME
    return shares.reshape(len(xs), *np.shape(limbs))


def lagrange_at_zero(xs: list[int]) -> np.ndarray:
    """The weights λ_i with f(0) = Σ λ_i f(x_i) for a polynomial of degree < len(xs)."""
    return _lagrange(tuple(xs)).copy()


@functools.lru_cache(maxsize=256)
def _lagrange(xs: tuple[int, ...]) -> np.ndarray:
    """:func:`lagrange_at_zero`, once per point set (a server recovers many secrets from the same holders)."""
    out = []
    for i, xi in enumerate(xs):
        num, den = 1, 1
        for j, xj in enumerate(xs):
            if i != j:
                num = num * xj % PRIME
                den = den * (xj - xi) % PRIME
        out.append(num * pow(den, -1, PRIME) % PRIME)
    return np.asarray(out, dtype=np.int64)


def combine(xs: list[int], shares: np.ndarray) -> np.ndarray:
    """The limbs behind ``shares`` (one row per point of ``xs``, at least the threshold of them)."""
    if len(set(xs)) != len(xs):
        raise ValueError("shares must come from distinct points")
    weights = lagrange_at_zero(xs).reshape(-1, *([1] * (shares.ndim - 1)))
    return ((weights * (np.asarray(shares, dtype=np.int64) % PRIME)) % PRIME).sum(axis=0) % PRIME
