"""Shamir sharing over GF(2^31 − 1): recovery from any threshold of shares, by hand, and
threshold − 1 shares that say nothing of the secret."""

from __future__ import annotations

import numpy as np
import pytest

from fedweave.plugins.secure import shamir


def test_shamir_recovers_from_any_threshold_of_shares_and_not_fewer() -> None:
    secrets = [bytes(range(32)), bytes(range(100, 132))]
    limbs = shamir.to_limbs(secrets)
    assert limbs.shape == (2, 16) and limbs[0, 0] == 0x0001 and limbs[1, 15] == (130 << 8) + 131
    xs = list(range(1, 8))
    shares = shamir.split(limbs, 4, xs)
    assert shares.shape == (7, 2, 16) and shares.max() < shamir.PRIME
    for subset in ([0, 1, 2, 3], [6, 4, 2, 0], [1, 3, 5, 6, 4]):
        assert shamir.from_limbs(shamir.combine([xs[i] for i in subset], shares[subset])) == secrets
    fewer = shamir.combine(xs[:3], shares[:3])
    assert not np.array_equal(fewer, limbs)  # three points of a cubic say nothing of f(0)


def test_shamir_by_hand_over_the_prime_field() -> None:
    # f(x) = 5 + 3x over GF(p): shares f(1) = 8, f(2) = 11; Lagrange at 0: 2·8 − 1·11 = 5
    assert shamir.lagrange_at_zero([1, 2]).tolist() == [2, shamir.PRIME - 1]
    assert shamir.combine([1, 2], np.array([[8], [11]])).tolist() == [5]
    with pytest.raises(ValueError, match="inconsistent"):
        shamir.from_limbs(np.array([[1 << 16]]))


def test_t_minus_one_shares_are_uniform_whatever_the_secret() -> None:
    """With threshold 2, one share is a uniform value independent of the secret."""
    draws = np.concatenate([shamir.split(np.array([s] * 4000), 2, [3, 5])[0] for s in (0, 65535)])
    counts = np.histogram(draws, bins=8, range=(0, shamir.PRIME))[0]
    assert ((counts - 1000) ** 2 / 1000).sum() < 24.3  # chi-square, 7 degrees of freedom, p = 0.001
