"""Verifiable Shamir sharing over GF(Q): recovery from any threshold of shares, by hand, shares
checked against the dealer's Pedersen commitments, and threshold − 1 shares that say nothing."""

from __future__ import annotations

import pytest

from fedweave.plugins.secure import pedersen, shamir

SECRETS = [int.from_bytes(bytes(range(16)), "big"), int.from_bytes(bytes(range(100, 116)), "big")]


def test_shamir_recovers_from_any_threshold_of_shares_and_not_fewer() -> None:
    xs = list(range(1, 8))
    dealt = shamir.split(SECRETS, 4, xs)
    assert len(dealt.shares) == 7 and all(len(row) == 2 for row in dealt.shares)
    assert [len(c) for c in dealt.commitments] == [4, 4]
    for subset in ([0, 1, 2, 3], [6, 4, 2, 0], [1, 3, 5, 6, 4]):
        for k, secret in enumerate(SECRETS):
            value, blinding = shamir.combine([xs[i] for i in subset], [dealt.shares[i][k] for i in subset])
            assert value == secret and shamir.opens((value, blinding), dealt.commitments[k][0])
    fewer = shamir.combine(xs[:3], [row[0] for row in dealt.shares[:3]])
    assert fewer[0] != SECRETS[0] and not shamir.opens(fewer, dealt.commitments[0][0])


def test_shamir_by_hand_over_the_prime_field() -> None:
    # f(x) = 5 + 3x over GF(Q): shares f(1) = 8, f(2) = 11; Lagrange at 0: 2·8 − 1·11 = 5
    assert shamir.lagrange_at_zero([1, 2]) == [2, shamir.PRIME - 1]
    assert shamir.combine([1, 2], [(8, 0), (11, 0)]) == (5, 0)
    # commitments to f = 5 + 3x, f' = 7 + 2x: the share at 2 is (11, 11), g^11 h^11 = C_0 · C_1^2
    g, h = pedersen.generators()
    c = [pow(g, 5, pedersen.P) * pow(h, 7, pedersen.P) % pedersen.P, pow(g, 3, pedersen.P) * pow(h, 2, pedersen.P) % pedersen.P]
    assert shamir.verify(2, (11, 11), c) and shamir.verify(1, (8, 9), c)
    assert not shamir.verify(2, (12, 11), c) and not shamir.verify(2, (11, 12), c)
    assert not shamir.verify(2, (11 + shamir.PRIME, 11), c)  # only canonical values


def test_a_consistent_but_shifted_share_fails_its_dealers_commitments() -> None:
    """A holder that shifts its share (any shift keeps a set of t shares "consistent": they always
    interpolate to some value) moves the recovered secret; the commitments catch it at once."""
    xs = [1, 2, 3]
    dealt = shamir.split(SECRETS, 3, xs)
    shifted = [(dealt.shares[0][0][0] + 1, dealt.shares[0][0][1]), dealt.shares[1][0], dealt.shares[2][0]]
    recovered = shamir.combine(xs, shifted)
    assert recovered[0] != SECRETS[0] and not shamir.opens(recovered, dealt.commitments[0][0])
    assert [shamir.verify(x, s, dealt.commitments[0]) for x, s in zip(xs, shifted)] == [False, True, True]


def test_t_minus_one_shares_are_uniform_whatever_the_secret() -> None:
    """With threshold 2, one share is a uniform value independent of the secret."""
    for secret in (0, SECRETS[0]):
        draws = [shamir.split([secret], 2, [3, 5]).shares[0][0][0] for _ in range(800)]
        counts = [0] * 8
        for d in draws:
            counts[d * 8 // shamir.PRIME] += 1
        assert sum((c - 100) ** 2 / 100 for c in counts) < 24.3  # chi-square, 7 degrees of freedom, p = 0.001
