"""The global sampler of data-parallel training: disjoint index ranges per step.

Each epoch is one seeded permutation of the training set. A step of B samples takes
the next B positions of it and cuts them into consecutive ranges of b_1, ..., b_n
samples, one per worker, so an epoch covers every sample exactly once whatever the
b_i are and however they change (workers leaving, the controller replanning). The
last step of an epoch takes what is left (fewer than B samples).

The sampler never advances by itself: :meth:`GlobalSampler.take` only reads, and
:meth:`GlobalSampler.advance` commits a completed step, so a step that fails (a worker
lost mid-step) is taken again, with new batch sizes, from the same position.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from fedweave.seeding import numpy_rng


class GlobalSampler:
    def __init__(self, num_samples: int, seed: int, *, epoch: int = 0, offset: int = 0):
        if num_samples < 1:
            raise ValueError("a sampler needs at least one sample")
        self.num_samples = num_samples
        self.seed = seed
        self.epoch = epoch
        self.offset = offset
        self._order: np.ndarray | None = None
        self._order_epoch = -1

    def order(self) -> np.ndarray:
        """The permutation of the current epoch (seeded by the run seed and the epoch)."""
        if self._order_epoch != self.epoch:
            self._order = numpy_rng(self.seed, "data-parallel-epoch", self.epoch).permutation(self.num_samples)
            self._order_epoch = self.epoch
        assert self._order is not None
        return self._order

    @property
    def remaining(self) -> int:
        """Samples of the current epoch not yet used."""
        return self.num_samples - self.offset

    def step_size(self, global_batch: int) -> int:
        """How many samples the next step takes: B, or the rest of the epoch."""
        return min(global_batch, self.remaining)

    def take(self, sizes: Sequence[int]) -> list[np.ndarray]:
        """Consecutive disjoint index arrays of ``sizes`` from the current position (not committed)."""
        if any(b < 0 for b in sizes):
            raise ValueError(f"batch sizes must be non-negative, got {list(sizes)}")
        total = sum(sizes)
        if total > self.remaining:
            raise ValueError(f"a step of {total} samples exceeds the {self.remaining} left in epoch {self.epoch}")
        cuts = self.offset + np.cumsum([0, *sizes])
        order = self.order()
        return [order[a:b] for a, b in zip(cuts[:-1], cuts[1:])]

    def advance(self, count: int) -> None:
        """Commit a step of ``count`` samples; the epoch rolls over when it is used up."""
        if not 0 < count <= self.remaining:
            raise ValueError(f"cannot advance by {count} with {self.remaining} samples left")
        self.offset += count
        if self.offset == self.num_samples:
            self.epoch += 1
            self.offset = 0

    def state_dict(self) -> dict[str, Any]:
        return {"num_samples": self.num_samples, "seed": self.seed, "epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["num_samples"]) != self.num_samples or int(state["seed"]) != self.seed:
            raise ValueError("sampler state belongs to another dataset or seed")
        self.epoch = int(state["epoch"])
        self.offset = int(state["offset"])


def steps_per_epoch(num_samples: int, global_batch: int) -> int:
    """Steps of one epoch: ceil(N / B) (the last one may be short)."""
    return -(-num_samples // global_batch)
