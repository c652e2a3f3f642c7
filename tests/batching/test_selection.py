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
