"""Client sampling: pure functions of a generator."""

from __future__ import annotations

import numpy as np


def sample_clients(rng: np.random.Generator, num_clients: int, count: int) -> list[int]:
    """``count`` distinct client ids out of ``num_clients``, in increasing order.

    O(count) for a large population: numpy's ``choice`` without replacement draws a few ids
    of many with Floyd's algorithm (a set of the chosen), never a permutation of all."""
    if not 1 <= count <= num_clients:
        raise ValueError(f"cannot sample {count} of {num_clients} clients")
    if count == num_clients:
        return list(range(num_clients))
    return sorted(int(i) for i in rng.choice(num_clients, size=count, replace=False))
