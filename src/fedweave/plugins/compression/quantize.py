"""Quantization to fewer bits per entry: float16, bfloat16 or int8.

float16 and bfloat16 halve the bytes (a cast; bfloat16 keeps float32's range with 8 bits
of mantissa, float16 its precision to 11 bits within ±65,504). int8 quarters them: each
bucket of ``bucket`` entries is scaled by its largest magnitude to [-127, 127] and
rounded (stochastically by default, which makes it unbiased), and travels as int8
values (``name.__values``) plus one float32 scale per bucket (``name.__scales``).

float16 and bfloat16 payloads of different clients line up entry by entry, so they can
be summed while encoded (secure aggregation, HE); int8's per-client scales cannot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from fedweave.plugins.compression.qsgd import bucketed, stochastic_round
from fedweave.plugins.compression.wire import Compressor, Site
from fedweave.schema import opt
from fedweave.types import UpdateKind

CASTS = {"float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class QuantizeParams:
    dtype: Literal["float16", "bfloat16", "int8"] = opt("int8", help="what each entry is sent as")
    bucket: int = opt(512, ge=1, help="int8: entries per bucket, each with its own scale")
    stochastic: bool = opt(True, help="int8: round at random (unbiased) rather than to the nearest")
    error_feedback: bool = opt(False, help="keep the rounding error and add it next time")


class QuantizeCodec:
    def __init__(self, hp: QuantizeParams):
        self.hp = hp

    def compress(self, x: torch.Tensor, site: Site) -> dict[str, torch.Tensor]:
        if self.hp.dtype in CASTS:
            return {"values": x.to(CASTS[self.hp.dtype])}
        flat = x.reshape(-1)
        rows = bucketed(flat, self.hp.bucket)
        scales = rows.abs().amax(dim=1, keepdim=True) / 127
        scaled = rows / torch.where(scales > 0, scales, torch.ones_like(scales))
        if self.hp.stochastic:
            rounded = stochastic_round(scaled, site.generator(site.client_id, site.name))
        else:
            rounded = scaled.round_()
        values = rounded.clamp_(-127, 127).reshape(-1)[: flat.numel()].to(torch.int8)
        return {"values": values, "scales": scales.reshape(-1)}

    def decompress(self, fields: dict[str, torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        values = fields["values"].to(torch.float32)
        if "scales" not in fields:
            return values.reshape(shape)
        rows = bucketed(values.reshape(-1), self.hp.bucket) * fields["scales"].reshape(-1, 1)
        return rows.reshape(-1)[: values.numel()].reshape(shape)


def _summable(params: Any) -> bool:
    return params.dtype in CASTS


class Quantize(Compressor):
    """Quantization to float16, bfloat16 or int8 (per-bucket scales, stochastic rounding)."""

    name = "quantize"
    Params = QuantizeParams
    accepts = frozenset(UpdateKind)
    summable = staticmethod(_summable)

    def __init__(self, hp: QuantizeParams):
        super().__init__(QuantizeCodec(hp), hp.error_feedback)
        self.hp = hp
