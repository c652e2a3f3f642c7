"""Verifiable Shamir secret sharing: Pedersen's scheme over GF(Q), Q the prime order of the
group of :mod:`~fedweave.plugins.secure.pedersen`.

Shamir, "How to Share a Secret", CACM 1979; Pedersen, CRYPTO 1991. A secret s < Q is the
constant term of a random polynomial f of degree t − 1 over GF(Q); share i is f(x_i) at a
non-zero point x_i. Any t shares give s back by Lagrange interpolation at 0; fewer reveal
nothing about it. Each secret has a second random polynomial f' (its blinding), and the
dealer publishes the commitments C_j = g^(a_j) h^(a'_j) to the coefficients of both: a
share (f(x), f'(x)) is checked against them without learning anything about s
(:func:`verify`: g^f(x) h^f'(x) = Π_j C_j^(x^j)), so a holder can tell a share that is not
on the dealer's polynomial, and the one who reconstructs a share that is not the one
dealt. Coefficients come from the operating system's cryptographic source (``secrets``).
"""

from __future__ import annotations

import functools
import secrets
from dataclasses import dataclass

from fedweave.plugins.secure import pedersen

PRIME = pedersen.Q
Share = tuple[int, int]
"""(f(x), f'(x)): a share of a secret and of its blinding."""


@dataclass(frozen=True)
class Dealt:
    """One dealer's sharing: ``shares[i][k]``, the share of secret k at point i; ``commitments[k][j]``,
    the commitment to the coefficients of x^j of secret k's two polynomials."""

    shares: list[list[Share]]
    commitments: list[list[int]]


def split(values: list[int], threshold: int, xs: list[int]) -> Dealt:
    """Shares of every secret of ``values`` at the points ``xs``, any ``threshold`` of which recover it
    (:func:`combine`), with the commitments that make each share verifiable."""
    if not 1 <= threshold <= len(xs):
        raise ValueError(f"threshold {threshold} needs between 1 and {len(xs)} shares")
    if len(set(xs)) != len(xs) or min(xs) < 1 or max(xs) >= PRIME:
        raise ValueError("share points must be distinct and in [1, Q)")
    if not all(0 <= v < PRIME for v in values):
        raise ValueError("a secret must be in [0, Q)")
    shares: list[list[Share]] = [[] for _ in xs]
    commitments = []
    for value in values:
        f = [value, *(secrets.randbelow(PRIME) for _ in range(threshold - 1))]
        blind = [secrets.randbelow(PRIME) for _ in range(threshold)]
        commitments.append([pedersen.commit(a, b) for a, b in zip(f, blind)])
        for row, x in zip(shares, xs):
            row.append((_at(f, x), _at(blind, x)))
    return Dealt(shares, commitments)


def _at(coefficients: list[int], x: int) -> int:
    out = 0
    for c in reversed(coefficients):
        out = (out * x + c) % PRIME
    return out


def verify(x: int, share: Share, commitments: list[int]) -> bool:
    """Whether ``share`` at point ``x`` lies on the polynomials ``commitments`` commit to."""
    value, blinding = share
    if not (0 <= value < PRIME and 0 <= blinding < PRIME):
        return False
    return pedersen.commit(value, blinding) == pedersen.evaluate(commitments, x)


def opens(share: Share, commitment: int) -> bool:
    """Whether ``share``, a recovered (secret, blinding), is the one ``commitment`` (C_0) commits to."""
    return pedersen.commit(*share) == commitment


def lagrange_at_zero(xs: list[int]) -> list[int]:
    """The weights λ_i with f(0) = Σ λ_i f(x_i) for a polynomial of degree < len(xs)."""
    return list(_lagrange(tuple(xs)))


@functools.lru_cache(maxsize=256)
def _lagrange(xs: tuple[int, ...]) -> tuple[int, ...]:
    """:func:`lagrange_at_zero`, once per point set (a server recovers many secrets from the same holders)."""
    out = []
    for i, xi in enumerate(xs):
        num, den = 1, 1
        for j, xj in enumerate(xs):
            if i != j:
                num = num * xj % PRIME
                den = den * (xj - xi) % PRIME
        out.append(num * pow(den, -1, PRIME) % PRIME)
    return tuple(out)


def combine(xs: list[int], shares: list[Share]) -> Share:
    """The (secret, blinding) behind ``shares``, one per point of ``xs`` (at least the threshold of them)."""
    if len(set(xs)) != len(xs):
        raise ValueError("shares must come from distinct points")
    weights = lagrange_at_zero(xs)
    return (
        sum(w * s for w, (s, _) in zip(weights, shares)) % PRIME,
        sum(w * b for w, (_, b) in zip(weights, shares)) % PRIME,
    )
