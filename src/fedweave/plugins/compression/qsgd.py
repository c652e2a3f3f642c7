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

from dataclasses import dataclass

import torch

from fedweave.plugins.compression.wire import Compressor, Site
from fedweave.schema import opt


@dataclass
class QSGDParams:
    levels: int = opt(127, ge=1, le=32767, help="quantization levels s (127: one byte per entry)")
    bucket: int = opt(512, ge=1, help="entries per bucket, each with its own norm")
    error_feedback: bool = opt(False, help="keep the quantization error and add it next time")


def bucketed(flat: torch.Tensor, bucket: int) -> torch.Tensor:
    """``flat`` zero-padded to whole buckets, one bucket per row (a view when no padding
    is needed)."""
    pad = -flat.numel() % bucket
    return (torch.nn.functional.pad(flat, (0, pad)) if pad else flat).reshape(-1, bucket)


def stochastic_round(scaled: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``scaled`` rounded down or up at random, up with probability its fractional part
    (unbiased). Works in place: ``scaled`` holds its fractional part afterwards."""
    lower = scaled.floor()
    noise = torch.rand(scaled.shape, generator=generator)
    return lower.add_(noise.lt_(scaled.sub_(lower)))


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
    def __init__(self, hp: QSGDParams):
        self.hp = hp

    def compress(self, x: torch.Tensor, site: Site) -> dict[str, torch.Tensor]:
        s = self.hp.levels
        flat = x.reshape(-1)
        rows = bucketed(flat, self.hp.bucket)
        norms = rows.norm(dim=1, keepdim=True)
        scaled = rows.abs().div_(torch.where(norms > 0, norms, torch.ones_like(norms))).mul_(s)
        levels = stochastic_round(scaled, site.generator(site.client_id, site.name))
        levels = levels.copysign_(rows).reshape(-1)[: flat.numel()]
        if s <= 7:
            return {"nibbles": pack_nibbles(levels), "norms": norms.reshape(-1)}
        dtype = torch.int8 if s <= 127 else torch.int16
        return {"levels": levels.to(dtype), "norms": norms.reshape(-1)}

    def decompress(self, fields: dict[str, torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        numel = 1
        for size in shape:
            numel *= size
        levels = unpack_nibbles(fields["nibbles"], numel) if "nibbles" in fields else fields["levels"].to(torch.float32)
        rows = bucketed(levels, self.hp.bucket)
        values = rows * fields["norms"].reshape(-1, 1) / self.hp.levels
        return values.reshape(-1)[: levels.numel()].reshape(shape)


class QSGD(Compressor):
    """QSGD (Alistarh et al. 2017): unbiased stochastic quantization to s levels per bucket."""

    name = "qsgd"
    Params = QSGDParams

    def __init__(self, hp: QSGDParams):
        super().__init__(QSGDCodec(hp), hp.error_feedback)
        self.hp = hp
