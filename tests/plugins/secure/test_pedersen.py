"""The Pedersen group: P and Q prime, Q divides P − 1, g and h of order Q, the fixed-base tables
agree with ``pow``."""

from __future__ import annotations

import hashlib
import random

import pytest

from fedweave.plugins.secure import pedersen


def probably_prime(n: int, rounds: int = 16) -> bool:
    """Miller–Rabin with bases from a seeded generator (a composite passes with probability 4^-16)."""
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    rng = random.Random(0)
    for _ in range(rounds):
        x = pow(rng.randrange(2, n - 1), d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def test_the_group_is_a_schnorr_group_derived_from_its_strings() -> None:
    assert pedersen.P.bit_length() == 2048 and pedersen.Q.bit_length() == 256
    assert probably_prime(pedersen.Q) and probably_prime(pedersen.P) and (pedersen.P - 1) % pedersen.Q == 0
    start = int.from_bytes(hashlib.sha256(b"fedweave pedersen q").digest(), "big") | (1 << 255) | 1
    assert all(not probably_prime(c, 2) for c in range(start, pedersen.Q, 2))  # the first prime from the string
    g, h = pedersen.generators()
    assert g != h and 1 not in (g, h) and pow(g, pedersen.Q, pedersen.P) == 1 == pow(h, pedersen.Q, pedersen.P)


def test_a_commitment_is_g_to_the_value_times_h_to_the_blinding() -> None:
    g, h = pedersen.generators()
    for a, b in [(0, 0), (1, 0), (0, 1), (pedersen.Q - 1, 12345), (2**200 + 7, 2**255 + 3)]:
        assert pedersen.commit(a, b) == pow(g, a, pedersen.P) * pow(h, b, pedersen.P) % pedersen.P
    c0, c1 = pedersen.commit(5, 7), pedersen.commit(3, 2)
    assert pedersen.evaluate([c0, c1], 2) == pedersen.commit(11, 11)  # 5 + 3·2, 7 + 2·2


def test_an_element_is_read_from_its_bytes_within_the_group() -> None:
    assert pedersen.to_element((5).to_bytes(pedersen.ELEMENT_BYTES, "big")) == 5
    for bad in (0, pedersen.P, 2**2048 - 1):
        with pytest.raises(ValueError, match="not an element of the group"):
            pedersen.to_element(bad.to_bytes(pedersen.ELEMENT_BYTES, "big"))
