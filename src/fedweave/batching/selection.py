"""Client sampling: pure functions of a generator."""

from __future__ import annotations

from collections.abc import Collection

import numpy as np


def sample_clients(rng: np.random.Generator, num_clients: int, count: int, absent: Collection[int] = ()) -> list[int]:
    """``count`` distinct client ids out of ``num_clients``, none of them ``absent``, in increasing order.

    O(count + |absent|) for a large population: numpy's ``choice`` without replacement draws a
    few ids of many with Floyd's algorithm (a set of the chosen), never a permutation of all.
    With clients ``absent`` (known gone) it draws |absent| more and keeps the first ``count``
    present ones in the order drawn (the draw is a uniformly random sequence, so they are a
    uniform sample of the present clients), or every present one if fewer are left. Without,
    the draw is the plain one, so a run where nobody is gone samples exactly as before."""
    if not 1 <= count <= num_clients:
        raise ValueError(f"cannot sample {count} of {num_clients} clients")
    gone = {i for i in absent if 0 <= i < num_clients}
    size = min(count + len(gone), num_clients)
    if size == num_clients:
        drawn = range(num_clients) if not gone else rng.permutation(num_clients)
    else:
        drawn = rng.choice(num_clients, size=size, replace=False)
    present = [int(i) for i in drawn if int(i) not in gone]
    return sorted(present[:count])
