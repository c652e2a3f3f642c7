"""Seeds derived from the run seed and a purpose, so every random choice is reproducible.

Each draw gets its own stream, keyed by what it is for (``"sample", round``,
``"client", round, client_id``, ...). No stream depends on how many numbers another
consumed, so a resumed run draws exactly what an uninterrupted one would.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch


def _key(part: int | str) -> int:
    return part if isinstance(part, int) else zlib.crc32(part.encode())


def derive_seed(seed: int, *keys: int | str) -> int:
    """A 63-bit seed for the stream named by ``keys`` under run seed ``seed``."""
    state = np.random.SeedSequence([seed, *(_key(k) for k in keys)]).generate_state(1, np.uint64)
    return int(state[0]) & ((1 << 63) - 1)


def numpy_rng(seed: int, *keys: int | str) -> np.random.Generator:
    return np.random.default_rng(derive_seed(seed, *keys))


def torch_generator(seed: int, *keys: int | str) -> torch.Generator:
    return torch.Generator().manual_seed(derive_seed(seed, *keys))
