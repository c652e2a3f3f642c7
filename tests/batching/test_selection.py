"""Tests of fedweave.batching.selection: seeded sampling of distinct clients."""

from __future__ import annotations

from collections import Counter

import pytest

from fedweave.batching.selection import sample_clients
from fedweave.seeding import numpy_rng


def test_distinct_sorted_ids_in_range() -> None:
    for rnd in range(1, 30):
        ids = sample_clients(numpy_rng(0, "sample", rnd), 50, 7)
        assert len(ids) == 7 and len(set(ids)) == 7
        assert ids == sorted(ids) and all(0 <= i < 50 for i in ids)
        assert all(type(i) is int for i in ids)


def test_seeded() -> None:
    assert sample_clients(numpy_rng(0, "sample", 1), 10, 3) == [2, 3, 6]
    assert sample_clients(numpy_rng(0, "sample", 1), 10, 3) == sample_clients(numpy_rng(0, "sample", 1), 10, 3)
    rounds = {tuple(sample_clients(numpy_rng(0, "sample", r), 100, 10)) for r in range(1, 11)}
    assert len(rounds) == 10


def test_all_clients_when_count_is_everyone() -> None:
    assert sample_clients(numpy_rng(0), 4, 4) == [0, 1, 2, 3]


def test_every_client_is_chosen_about_as_often() -> None:
    counts = Counter(i for r in range(2000) for i in sample_clients(numpy_rng(1, "sample", r), 10, 3))
    assert set(counts) == set(range(10))
    # 600 expected each (2000 rounds × 3 / 10); the binomial standard deviation is about 20
    assert all(500 < c < 700 for c in counts.values())


@pytest.mark.parametrize("count", [0, 11, -1])
def test_impossible_counts(count: int) -> None:
    with pytest.raises(ValueError, match=f"cannot sample {count} of 10 clients"):
        sample_clients(numpy_rng(0), 10, count)


def test_sampling_costs_the_sampled_clients_not_the_population() -> None:
    """100 of 10^12 clients: anything that touched every id would need terabytes."""
    ids = sample_clients(numpy_rng(0, "sample", 1), 10**12, 100)
    assert len(set(ids)) == 100 and ids == sorted(ids) and all(0 <= i < 10**12 for i in ids)
    assert ids == sample_clients(numpy_rng(0, "sample", 1), 10**12, 100)


def test_absent_clients_are_never_sampled_and_the_present_ones_stay_uniform() -> None:
    """Clients a transport knows are gone are replaced by present ones: 3 of the 8 present of
    10 each round, every present one chosen about as often (2000 × 3 / 8 = 750 expected, the
    binomial standard deviation about 22)."""
    absent = {2, 7}
    counts: Counter[int] = Counter()
    for r in range(2000):
        ids = sample_clients(numpy_rng(1, "sample", r), 10, 3, absent)
        assert len(ids) == 3 and ids == sorted(set(ids)) and not absent & set(ids)
        counts.update(ids)
    assert set(counts) == set(range(10)) - absent
    assert all(650 < c < 850 for c in counts.values())


def test_with_nobody_absent_the_draw_is_the_plain_one() -> None:
    """A run where nobody is gone (every simulation) samples bit for bit as without the argument."""
    for r in range(1, 50):
        assert sample_clients(numpy_rng(3, "sample", r), 20, 5, ()) == sample_clients(numpy_rng(3, "sample", r), 20, 5)
        assert sample_clients(numpy_rng(3, "sample", r), 20, 5, {25, -1}) == sample_clients(numpy_rng(3, "sample", r), 20, 5)
    assert sample_clients(numpy_rng(0, "sample", 1), 10, 3, set()) == [2, 3, 6]


def test_fewer_present_clients_than_the_count_are_all_sampled() -> None:
    assert sample_clients(numpy_rng(0), 4, 3, {1, 2}) == [0, 3]
    assert sample_clients(numpy_rng(0), 4, 4, {2}) == [0, 1, 3]
    assert sample_clients(numpy_rng(0), 4, 2, {0, 1, 2, 3}) == []
    ids = sample_clients(numpy_rng(0, "sample", 1), 10**12, 100, {5, 10**11})  # still O(count) of a huge population
    assert len(ids) == 100 and 5 not in ids and 10**11 not in ids
