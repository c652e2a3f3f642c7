"""Top-k sparsification: send the k largest-magnitude entries of each tensor.

Aji & Heafield, "Sparse Communication for Distributed Gradient Descent", EMNLP 2017
(https://arxiv.org/abs/1704.05021); with error feedback as in Lin et al., "Deep Gradient
Compression", ICLR 2018 (https://arxiv.org/abs/1712.01887).

Each tensor travels as ``name.__values`` (the k values) and ``name.__indices`` (their
flat positions, sorted, 2 bytes each: offsets within blocks of 65,536 entries, with a
count per block in ``name.__blocks``; :mod:`fedweave.plugins.compression.indices`). At
ratio 1 % with float32 values that is about 6 bytes per sent entry, some 66x fewer bytes
than dense; float16 values give about 100x.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from fedweave.plugins.compression.indices import check_packed, pack_indices, unpack_indices
from fedweave.plugins.compression.wire import Compressor, Site, require, vectors
from fedweave.schema import opt

VALUE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class TopKHParams:
    ratio: float = opt(0.01, gt=0, le=1, help="share of each tensor's entries sent (at least one)")
    error_feedback: bool = opt(True, help="keep what was not sent and add it to the next update")
    values: Literal["float32", "float16", "bfloat16"] = opt("float32", help="dtype of the sent values")


class TopKCodec:
    def __init__(self, hp: TopKHParams):
        self.hp = hp

    def k(self, numel: int) -> int:
        """How many entries of a tensor of ``numel`` entries are sent."""
        return max(1, int(self.hp.ratio * numel))

    def compress(self, x: torch.Tensor, site: Site) -> dict[str, torch.Tensor]:
        return self._select(x.reshape(-1))[0]

    def compress_many(self, xs: list[torch.Tensor], sites: list[Site]) -> list[dict[str, torch.Tensor]]:
        return [self._select(x.reshape(-1))[0] for x in xs]

    def compress_keeping_rest(self, xs: list[torch.Tensor], sites: list[Site]) -> list[dict[str, torch.Tensor]]:
        """The fields of each x, and x (the caller's, contiguous) left holding what they do not
        carry: at the sent positions x less the sent value (x - x unless the values travel in
        fewer bits), elsewhere x as it was."""
        out = []
        for x in xs:
            flat = x.view(-1)
            fields, indices, exact = self._select(flat)
            sent = fields["values"]
            flat.index_put_((indices,), exact - (sent if sent.dtype == torch.float32 else sent.to(torch.float32)))
            out.append(fields)
        return out

    def _select(self, flat: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
        """The fields of the vector ``flat``, the sorted positions they carry, and ``flat``'s
        entries there in float32 (the values field itself when it is float32)."""
        indices = largest(flat.abs(), self.k(flat.numel()))
        exact = flat.index_select(0, indices)
        dtype = VALUE_DTYPES[self.hp.values]
        values = exact if dtype == torch.float32 else exact.to(dtype)
        return {"values": values, **pack_indices(indices, flat.numel())}, indices, exact

    def field_dtypes(self) -> dict[str, torch.dtype]:
        return {"values": VALUE_DTYPES[self.hp.values], "indices": torch.int16, "blocks": torch.int32}

    def check_fields(self, fields: dict[str, torch.Tensor], shape: tuple[int, ...]) -> None:
        numel = math.prod(shape)
        vectors(fields)
        require(fields, {"values": self.k(numel)})
        check_packed(fields, numel, self.k(numel))

    def decompress(self, fields: dict[str, torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        return self.decompress_many([fields], [shape])[0]

    def decompress_many(self, fields: list[dict[str, torch.Tensor]], shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
        """Every tensor of a payload scattered into one zeroed buffer (views of it, one per tensor)."""
        numels = [math.prod(shape) for shape in shapes]
        out = torch.zeros(sum(numels), dtype=torch.float32)
        values = torch.cat([f["values"] for f in fields])
        values = values if values.dtype == torch.float32 else values.to(torch.float32)
        out.index_put_((torch.from_numpy(unpack_indices(fields, numels)),), values)
        return [part if len(shape) == 1 else part.view(shape) for part, shape in zip(out.split(numels), shapes)]


SAMPLE = 4096
"""Entries of a strided sample that estimates where the k largest begin."""


def largest(magnitude: torch.Tensor, k: int) -> torch.Tensor:
    """The sorted positions of the ``k`` largest entries of the vector ``magnitude``.

    ``torch.topk`` over the whole vector costs a selection pass over every entry on one
    core; here a strided sample of it bounds from below where the k largest begin, and
    only the entries above that floor (a few times k) are searched for the k-th largest
    value. When exactly k entries are at or above it (no tie at the threshold, no NaN among
    them; a NaN anywhere counts as one, since it is not below the floor), they are the set
    ``topk`` over everything picks, already in order; otherwise, or when the floor was too
    high, ``topk`` over everything decides, so the positions never depend on which path ran.
    """
    numel = magnitude.numel()
    stride = numel // SAMPLE
    if stride > 1 and 8 * k < numel:
        values = magnitude.numpy()
        sample = values[::stride]
        rank = min(sample.size, 2 * (k * sample.size // numel) + 16)
        floor = np.partition(sample, sample.size - rank)[sample.size - rank]
        candidates = np.flatnonzero(~(values < floor))  # a NaN is a candidate, and sends it to topk below
        if candidates.size >= k:
            above = values[candidates]
            if not np.isnan(above).any():
                kth = np.partition(above, above.size - k)[above.size - k]
                chosen = candidates[above >= kth]
                if chosen.size == k:
                    return torch.from_numpy(chosen)
    return magnitude.topk(k, sorted=False).indices.sort().values


class TopK(Compressor):
    """Top-k sparsification (Aji & Heafield 2017) with error feedback."""

    name = "topk"
    HParams = TopKHParams

    def __init__(self, hp: TopKHParams):
        super().__init__(TopKCodec(hp), hp.error_feedback)
        self.hp = hp
