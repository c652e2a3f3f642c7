"""SecAgg's quantization: clipping and stochastic rounding of real entries to the field's integers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Quantizer:
    """Clipping to [−R, R] and stochastic rounding to integers in [0, levels].

    An entry maps to t = (x + R) · levels / 2R. It is rounded to the nearest multiple of
    2^−f (f = ``fraction_bits``: 8 where the real type and the field have room, so within
    2^−9 of a step), then up with probability its fractional part, by adding f uniform
    bits and shifting them out: E[q] = t within 2^−9 of a step. In place, no per-entry
    Python.
    """

    clip: float
    levels: int
    real: Any  # np.float32 or np.float64
    fraction_bits: int

    @classmethod
    def of(cls, clip: float, levels: int, width: int) -> Quantizer:
        used = levels.bit_length()
        real = np.float32 if used + 8 <= 24 else np.float64
        mantissa = 24 if real is np.float32 else 53
        return cls(clip, levels, real, max(0, min(8, mantissa - used, width - used)))

    def inside(self, low: float, high: float) -> bool:
        """Whether entries within [low, high] need no clipping: inside [−R, R] by a margin of
        two fine steps (2^−f of a level), more than the real type's rounding can add."""
        margin = 2 * (2 * self.clip) / (self.levels * (1 << self.fraction_bits))
        return bool(low >= -self.clip + margin and high <= self.clip - margin)

    def __call__(
        self, x: np.ndarray, noise: np.ndarray, work: np.ndarray, spare: np.ndarray, out: np.ndarray, inside: bool = False
    ) -> None:
        """``out`` = the quantized ``x``. ``noise``: one uniform byte per entry, read first;
        ``work`` (real, may be ``x``) and ``spare`` (of ``out``'s type, may overlap ``noise``): scratch.
        ``inside``: :meth:`inside` holds for ``x``'s range, so the clipping pass is skipped."""
        f = self.fraction_bits
        np.copyto(out, noise if f == 8 else noise >> (8 - f), casting="unsafe")  # f random bits
        scale = self.levels / (2 * self.clip) * (1 << f)
        np.multiply(x, self.real(scale), out=work)
        work += self.real(self.clip * scale + 0.5)  # + 0.5: to the nearest multiple of 2^-f
        if not inside:
            np.clip(work, 0.5, self.levels * (1 << f) + 0.5, out=work)
        np.copyto(spare, work, casting="unsafe")  # truncation: the floor, as work > 0
        out += spare
        np.right_shift(out, out.dtype.type(f), out=out)
