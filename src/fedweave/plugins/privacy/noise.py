"""Where privacy noise comes from: the operating system's secure source, or a seeded stream.

Every node reads the same config, so noise drawn from generators seeded by the run seed,
the round and the client id can be drawn again by anyone holding the config: the server
would regenerate a client's noise and subtract it. By default the DP plugins therefore
draw from :class:`SecureNoise`, which takes every uniform from ``os.urandom`` (the OS's
cryptographically secure source) and turns pairs of them into standard normals
(Box–Muller). Reseeding a ``torch.Generator`` from ``secrets`` would not do: its
Mersenne Twister keeps only 32 bits of a seed, which a server can search.

:class:`SeededNoise` (the plugins' ``seeded_noise: true``) draws reproducibly from the
run seed and a purpose, for simulations that must repeat bit for bit;
:mod:`fedweave.plugins.compose` refuses it in deployments.
"""

from __future__ import annotations

import math
import os
from typing import Protocol

import numpy as np
import torch

from fedweave.seeding import torch_generator

_UNIT = 2.0**-53


class NoiseSource(Protocol):
    """Standard normal and uniform [0, 1) draws in float64."""

    def normal(self, shape: tuple[int, ...]) -> torch.Tensor: ...

    def uniform(self, shape: tuple[int, ...]) -> torch.Tensor: ...


def _secure_uniform(count: int) -> np.ndarray:
    """``count`` uniforms in (0, 1], each from 53 bits of ``os.urandom``."""
    bits = np.frombuffer(os.urandom(8 * count), dtype=np.uint64) >> np.uint64(11)
    return (bits.astype(np.float64) + 1.0) * _UNIT


class SecureNoise:
    """Draws from ``os.urandom``: nothing in the config, nor any earlier draw, predicts them."""

    def normal(self, shape: tuple[int, ...]) -> torch.Tensor:
        count = math.prod(shape)
        pairs = (count + 1) // 2
        u = _secure_uniform(2 * pairs)
        radius = np.sqrt(-2.0 * np.log(u[:pairs]))
        angle = 2.0 * math.pi * u[pairs:]
        values = np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[:count]
        return torch.from_numpy(values).reshape(shape)

    def uniform(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.from_numpy(1.0 - _secure_uniform(math.prod(shape))).reshape(shape)


class SeededNoise:
    """Draws from a generator seeded by the run seed and ``keys``: reproducible, for simulation only."""

    def __init__(self, seed: int, *keys: int | str):
        self.generator = torch_generator(seed, *keys)

    def normal(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randn(shape, generator=self.generator, dtype=torch.float64)

    def uniform(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.rand(shape, generator=self.generator, dtype=torch.float64)


def noise_source(seeded: bool, seed: int, *keys: int | str) -> NoiseSource:
    """The secure source, or (``seeded``) the reproducible stream of ``seed`` and ``keys``."""
    return SeededNoise(seed, *keys) if seeded else SecureNoise()
