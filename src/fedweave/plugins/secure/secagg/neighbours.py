"""SecAgg+'s neighbourhoods: who masks with whom, and the threshold of a neighbourhood."""

from __future__ import annotations

import functools
import math

from fedweave.seeding import numpy_rng


@functools.lru_cache(maxsize=8)
def ring(seed: int, rnd: int, cohort: tuple[int, ...], neighbours: int | None) -> dict[int, tuple[int, ...]]:
    """Each client's masking neighbours, public: all others (SecAgg), or ``neighbours`` of them
    on a ring over a permutation of the cohort seeded by the run seed and the round (SecAgg+)."""
    n = len(cohort)
    half = n if neighbours is None else math.ceil(neighbours / 2)
    if 2 * half >= n - 1:
        return {u: tuple(v for v in cohort if v != u) for u in cohort}
    order = [cohort[i] for i in numpy_rng(seed, "secagg", "graph", rnd).permutation(n)]
    return {u: tuple(sorted(order[(i + d) % n] for d in range(-half, half + 1) if d)) for i, u in enumerate(order)}


def threshold_of(fraction: float, neighbours: int) -> int:
    """t of a neighbourhood of ``neighbours`` others and the client itself."""
    return math.ceil(fraction * (neighbours + 1))
