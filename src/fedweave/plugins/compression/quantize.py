"""Quantization to fewer bits per entry: float16, bfloat16 or int8.

float16 and bfloat16 halve the bytes (a cast; bfloat16 keeps float32's range with 8 bits
of mantissa, float16 its precision to 11 bits within ±65,504). int8 quarters them: each
bucket of ``bucket`` entries is scaled by its largest magnitude to [-127, 127] and
rounded (stochastically by default, which makes it unbiased), and travels as int8
values (``name.__values``) plus one float32 scale per bucket (``name.__scales``).

float16 and bfloat16 payloads of different clients line up entry by entry, so they can
be summed while encoded (secure aggregation); int8's per-client scales cannot. (HE adds
each update into the encrypted model itself, so no compressor may precede it.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

from fedweave.plugins.compression.buckets import layout, nonzero, products, stochastic_round
from fedweave.plugins.compression.wire import COMPRESSOR, Compressor, Site, require, tensor_seeds
from fedweave.schema import opt
from fedweave.types import UpdateKind

CASTS = {"float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class QuantizeHParams:
    dtype: Literal["float16", "bfloat16", "int8"] = opt("int8", help="what each entry is sent as")
    bucket: int = opt(512, ge=1, help="int8: entries per bucket, each with its own scale")
    stochastic: bool = opt(True, help="int8: round at random (unbiased) rather than to the nearest")
    error_feedback: bool = opt(False, help="keep the rounding error and add it next time")


class QuantizeCodec:
    def __init__(self, hp: QuantizeHParams):
        self.hp = hp

    def compress(self, x: torch.Tensor, site: Site) -> dict[str, torch.Tensor]:
        return self.compress_many([x], [site])[0]

    def field_dtypes(self) -> dict[str, torch.dtype]:
        if self.hp.dtype in CASTS:
            return {"values": CASTS[self.hp.dtype]}
        return {"values": torch.int8, "scales": torch.float32}

    def check_fields(self, fields: dict[str, torch.Tensor], shape: tuple[int, ...]) -> None:
        numel = math.prod(shape)
        scales = {} if self.hp.dtype in CASTS else {"scales": -(-numel // self.hp.bucket)}
        require(fields, {"values": numel, **scales})
        if not scales and fields["values"].shape != shape:  # a cast of the tensor, in its shape
            raise ValueError(f"'values' is of shape {tuple(fields['values'].shape)}, the layout's tensor {shape}")

    def decompress(self, fields: dict[str, torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        return self.decompress_many([fields], [shape])[0]

    def compress_many(self, xs: list[torch.Tensor], sites: list[Site]) -> list[dict[str, torch.Tensor]]:
        """Casts tensor by tensor; int8 for every tensor in one pass over the matrix of their buckets."""
        if self.hp.dtype in CASTS:
            return [{"values": x.to(CASTS[self.hp.dtype])} for x in xs]
        buckets = layout(tuple(x.numel() for x in xs), self.hp.bucket)
        rows, _ = buckets.matrix(xs)
        magnitudes = rows.abs()  # its buffer then takes the noise
        scales = magnitudes.amax(dim=1, keepdim=True).div_(127)
        noise = None
        if self.hp.stochastic:
            noise = buckets.draws(tensor_seeds(sites), out=magnitudes)
        values = int8_values(rows, scales, noise)
        return [{"values": v, "scales": s} for v, s in zip(buckets.entries(values), buckets.per_bucket(scales))]

    def decompress_many(self, fields: list[dict[str, torch.Tensor]], shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
        out = {i: f["values"].to(torch.float32).reshape(shape) for i, (f, shape) in enumerate(zip(fields, shapes)) if "scales" not in f}
        scaled = [i for i, f in enumerate(fields) if "scales" in f]
        if scaled:
            buckets = layout(tuple(math.prod(shapes[i]) for i in scaled), self.hp.bucket)
            values = [fields[i]["values"] for i in scaled]
            rows = products(buckets, values, [fields[i]["scales"] for i in scaled], "values", "scales")
            for i, entries in zip(scaled, buckets.entries(rows, [shapes[i] for i in scaled])):
                out[i] = entries
        return [out[i] for i in range(len(fields))]


def int8_values(rows: torch.Tensor, scales: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
    """The int8 values of ``rows``, each row over its scale (one rounding; a row of scale
    0 as it is) rounded down or up at random, up where ``noise`` is below the fractional
    part (or to the nearest, ties to even, without ``noise``), then kept within ±127.
    Consumes ``rows`` and ``noise``."""
    rows.div_(nonzero(scales))
    rounded = rows.round_() if noise is None else stochastic_round(rows, noise)
    return rounded.clamp_(-127, 127).to(torch.int8)


def _summable(params: Any) -> bool:
    return params.dtype in CASTS


class Quantize(Compressor):
    """Quantization to float16, bfloat16 or int8 (per-bucket scales, stochastic rounding)."""

    name = "quantize"
    HParams = QuantizeHParams
    accepts = frozenset(UpdateKind)
    declares = replace(COMPRESSOR, summable=_summable)

    def __init__(self, hp: QuantizeHParams):
        super().__init__(QuantizeCodec(hp), hp.error_feedback)
        self.hp = hp
