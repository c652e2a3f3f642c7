"""The global sampler: disjoint ranges per step, every sample exactly once per epoch."""

from __future__ import annotations

import numpy as np
import pytest

from fedweave.data_parallel.controller import apportion
from fedweave.data_parallel.sampler import GlobalSampler, steps_per_epoch


def run_epoch(sampler: GlobalSampler, rng: np.random.Generator, global_batch: int) -> list[np.ndarray]:
    """One epoch with random worker counts and batch sizes each step; the index arrays used."""
    used = []
    epoch = sampler.epoch
    while sampler.epoch == epoch:
        total = sampler.step_size(global_batch)
        n = int(rng.integers(1, 6))
        sizes = apportion(total, rng.lognormal(0, 1, n).tolist())
        parts = sampler.take(sizes)
        assert [len(p) for p in parts] == sizes
        if rng.random() < 0.2:  # a failed step is taken again with other sizes
            parts = sampler.take(apportion(total, rng.lognormal(0, 1, n + 1).tolist()))
        used.extend(parts)
        sampler.advance(total)
    return used


@pytest.mark.parametrize("seed", range(20))
def test_each_index_exactly_once_per_epoch_whatever_the_batch_sizes(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 500))
    global_batch = int(rng.integers(1, 80))
    sampler = GlobalSampler(n, seed)
    for _ in range(3):
        used = np.concatenate(run_epoch(sampler, rng, global_batch))
        assert np.array_equal(np.sort(used), np.arange(n))


def test_steps_are_disjoint_consecutive_ranges_and_the_last_one_is_short() -> None:
    sampler = GlobalSampler(100, 0)
    order = sampler.order()
    a, b, c = sampler.take([10, 0, 22])
    assert np.array_equal(np.concatenate([a, b, c]), order[:32])
    assert np.array_equal(sampler.take([32])[0], order[:32])  # take does not advance
    for _ in range(3):
        sampler.advance(sampler.step_size(32))
    assert sampler.step_size(32) == 4 and sampler.remaining == 4
    sampler.advance(4)
    assert (sampler.epoch, sampler.offset) == (1, 0)
    assert steps_per_epoch(100, 32) == 4


def test_each_epoch_has_its_own_seeded_permutation() -> None:
    a, b = GlobalSampler(50, 7), GlobalSampler(50, 7)
    first = a.order().copy()
    assert np.array_equal(first, b.order())
    a.advance(50)
    assert not np.array_equal(first, a.order())
    assert not np.array_equal(first, GlobalSampler(50, 8).order())


def test_state_round_trip_and_misuse() -> None:
    a = GlobalSampler(40, 1)
    a.advance(40)
    a.advance(13)
    b = GlobalSampler(40, 1)
    b.load_state_dict(a.state_dict())
    assert np.array_equal(a.take([5, 5])[1], b.take([5, 5])[1])
    with pytest.raises(ValueError, match="exceeds"):
        a.take([20, 20])
    with pytest.raises(ValueError, match="another dataset"):
        GlobalSampler(41, 1).load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="advance"):
        a.advance(0)
