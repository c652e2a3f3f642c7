"""QSGD: stochastic quantization to s levels per bucket, unbiased.

Alistarh et al., "QSGD: Communication-Efficient SGD via Gradient Quantization and
Encoding", NeurIPS 2017 (https://arxiv.org/abs/1610.02132).

Each tensor is cut into buckets of ``bucket`` entries. An entry v of a bucket with L2
norm ‖b‖ becomes ‖b‖ · sign(v) · ℓ / s, where ℓ is |v| / ‖b‖ · s rounded down or up at
random with the probabilities that make E[ℓ] = |v| / ‖b‖ · s, so the estimate is
unbiased. Signed levels travel in 4 bits for s ≤ 7 (two per byte, ``name.__nibbles``),
as int8 for s ≤ 127 (``name.__levels``; "8-bit QSGD"), int16 up to 32,767, with one
float32 norm per bucket (``name.__norms``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fedweave.plugins.compression.buckets import layout, nonzero, products, stochastic_round
from fedweave.plugins.compression.wire import Compressor, Site, require, tensor_seeds, vectors
from fedweave.schema import opt


@dataclass
class QSGDHParams:
    levels: int = opt(127, ge=1, le=32767, help="quantization levels s (127: one byte per entry)")
    bucket: int = opt(512, ge=1, help="entries per bucket, each with its own norm")
    error_feedback: bool = opt(False, help="keep the quantization error and add it next time")


def pack_nibbles(levels: torch.Tensor) -> torch.Tensor:
    """Signed levels in [-7, 7], two per byte (offset by 8 into 4 bits)."""
    codes = (levels + 8).to(torch.uint8)
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_full((1,), 8)])
    return (codes[0::2] << 4) | codes[1::2]


def unpack_nibbles(packed: torch.Tensor, numel: int) -> torch.Tensor:
    codes = torch.stack([packed >> 4, packed & 15], dim=1).reshape(-1)[:numel]
    return codes.to(torch.float32) - 8


class QSGDCodec:
    def __init__(self, hp: QSGDHParams):
        self.hp = hp

    def compress(self, x: torch.Tensor, site: Site) -> dict[str, torch.Tensor]:
        return self.compress_many([x], [site])[0]

    def field_dtypes(self) -> dict[str, torch.dtype]:
        s = self.hp.levels
        levels = {"nibbles": torch.uint8} if s <= 7 else {"levels": torch.int8 if s <= 127 else torch.int16}
        return {**levels, "norms": torch.float32}

    def check_fields(self, fields: dict[str, torch.Tensor], shape: tuple[int, ...]) -> None:
        numel = math.prod(shape)
        levels = {"nibbles": -(-numel // 2)} if self.hp.levels <= 7 else {"levels": numel}
        vectors(fields)
        require(fields, {**levels, "norms": -(-numel // self.hp.bucket)})

    def decompress(self, fields: dict[str, torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        return self.decompress_many([fields], [shape])[0]

    def compress_many(self, xs: list[torch.Tensor], sites: list[Site]) -> list[dict[str, torch.Tensor]]:
        """Every tensor of an update in one pass of each kernel over the matrix of their buckets."""
        buckets = layout(tuple(x.numel() for x in xs), self.hp.bucket)
        magnitudes, entries = buckets.matrix(xs, magnitudes=True)  # the norms of |x| are those of x
        noise = buckets.draws(tensor_seeds(sites))
        norms = to_levels(magnitudes, self.hp.levels, noise)
        for signed, x in zip(entries, xs):
            signed.copysign_(x)
        per_tensor = buckets.per_bucket(norms)
        if self.hp.levels <= 7:
            return [{"nibbles": pack_nibbles(v), "norms": n} for v, n in zip(buckets.entries(magnitudes), per_tensor)]
        codes = magnitudes.to(self.field_dtypes()["levels"])
        return [{"levels": v, "norms": n} for v, n in zip(buckets.entries(codes), per_tensor)]

    def decompress_many(self, fields: list[dict[str, torch.Tensor]], shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
        numels = [math.prod(shape) for shape in shapes]
        buckets = layout(tuple(numels), self.hp.bucket)
        codes = [unpack_nibbles(f["nibbles"], n) if "nibbles" in f else f["levels"] for f, n in zip(fields, numels)]
        rows = products(buckets, codes, [f["norms"] for f in fields], "levels", "norms").div_(self.hp.levels)
        return buckets.entries(rows, shapes)


LOSSY_NORM = 2 * torch.finfo(torch.float32).tiny ** 0.5
"""Below this a row's norm may come out under its largest magnitude: that entry's square is
subnormal and lost bits (all of them below ~1e-23), so ``|v| / n * s`` may pass ``s``,
which int8 and 4-bit codes would wrap to the wrong sign. With such a row (or one of zero
or NaN norm) the levels are clamped to ``s``, which changes none of the other rows'; above
it a float32 norm is at least every magnitude of its row (a sum of squares, each correctly
rounded, is at least the largest), so no other encoding changes."""


def to_levels(magnitudes: torch.Tensor, s: int, noise: torch.Tensor) -> torch.Tensor:
    """QSGD's levels of a matrix of magnitudes, in place: each entry ``|v|`` of a row of
    norm ``n`` becomes ``|v| / n * s`` (two roundings, in that order; ``|v| * s`` in a
    zero row) rounded up where ``noise`` is below its fractional part, down elsewhere, and
    never past ``s`` (:data:`LOSSY_NORM`). Returns the norms, a ``(rows, 1)`` column; ``noise`` is spent."""
    norms = torch.linalg.vector_norm(magnitudes, dim=1, keepdim=True)
    low = float(norms.min())  # NaN when a norm is
    divisors = nonzero(norms, low)
    magnitudes.div_(divisors).mul_(s)
    stochastic_round(magnitudes, noise, out=magnitudes)
    # a lossy row, or a NaN one (divisor 1: its other entries' |v| * s passed s); not only rows of
    # zero norm (divisor 1: their |v| * s < 1e-18)
    if not low >= LOSSY_NORM and (low != 0 or float(divisors.min()) < LOSSY_NORM):
        magnitudes.clamp_(max=s)
    return norms


class QSGD(Compressor):
    """QSGD (Alistarh et al. 2017): unbiased stochastic quantization to s levels per bucket."""

    name = "qsgd"
    HParams = QSGDHParams

    def __init__(self, hp: QSGDHParams):
        super().__init__(QSGDCodec(hp), hp.error_feedback)
        self.hp = hp
