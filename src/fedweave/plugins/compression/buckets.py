"""The tensors of one payload cut into buckets, all as the rows of one matrix.

QSGD and int8 quantize each bucket of ``size`` entries with its own norm or scale. A
tensor is zero-padded to whole buckets, so each bucket belongs to one tensor; laying
the buckets of every tensor of an update out as the rows of one matrix lets a codec
quantize the whole update in a few passes of torch kernels, where one pass per tensor
would pay the same fixed cost for a 10-entry bias as for the 100,000-entry weight. The
random draws stay those of each tensor's own generator, row range by row range, so the
encoding of every tensor is the one it would have had on its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class Buckets:
    """Where each of a list of tensors lies in the matrix of their buckets."""

    def __init__(self, numels: Sequence[int], size: int):
        self.size = size
        self.numels = list(numels)
        self.rows = [-(-n // size) for n in self.numels]
        self.total = sum(self.rows)
        # the flattened matrix as [entries of tensor 1, its padding, entries of tensor 2, ...]
        self.pieces = [part for n, rows in zip(self.numels, self.rows) for part in (n, rows * size - n)]

    def matrix(
        self, tensors: Sequence[torch.Tensor], what: str = "values", padded: bool = True, magnitudes: bool = False
    ) -> torch.Tensor:
        """A float32 ``(buckets, size)`` matrix of ``tensors``' entries (their absolute values
        with ``magnitudes``), each tensor zero-padded to whole buckets (``padded``; else the
        padding is left as it comes: for a result only read through :meth:`entries`).
        ``ValueError`` when a tensor does not hold its number of entries."""
        for tensor, n in zip(tensors, self.numels):
            if tensor.numel() != n:
                raise ValueError(f"{what} hold {tensor.numel()} entries, the layout {n}")
        out = torch.empty(self.total, self.size, dtype=torch.float32)
        pieces = out.view(-1).split(self.pieces)
        for tensor, entries, padding in zip(tensors, pieces[0::2], pieces[1::2]):
            if magnitudes:
                torch.abs(tensor.reshape(-1), out=entries)
            else:
                entries.copy_(tensor.reshape(-1))
            if padded and padding.numel():
                padding.zero_()
        return out

    def column(self, per_bucket: Sequence[torch.Tensor], what: str) -> torch.Tensor:
        """One value per bucket of each tensor (a norm, a scale), as a ``(buckets, 1)`` column."""
        for values, rows in zip(per_bucket, self.rows):
            if values.numel() != rows:
                raise ValueError(f"{what} hold {values.numel()} entries, the layout's buckets are {rows}")
        return torch.cat([v.reshape(-1) for v in per_bucket]).to(torch.float32).reshape(-1, 1)

    def draws(self, generators: Sequence[torch.Generator]) -> torch.Tensor:
        """Uniform [0, 1) noise of the matrix's shape: each tensor's rows drawn from its own
        generator, as ``torch.rand((rows, size), generator=...)`` draws them."""
        noise = torch.empty(self.total, self.size, dtype=torch.float32)
        for generator, rows in zip(generators, noise.split(self.rows)):
            rows.uniform_(generator=generator)
        return noise

    def entries(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each tensor's entries of the flattened matrix ``flat`` (views, padding left out)."""
        return list(flat.split(self.pieces)[0::2])

    def per_bucket(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Each tensor's part of one value per bucket (views)."""
        return list(values.split(self.rows))


def stochastic_round(scaled: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """``scaled`` rounded down or up at random, up where ``noise`` (uniform in [0, 1)) is
    below its fractional part (unbiased). Works in place: ``scaled`` holds its fractional
    part afterwards, ``noise`` the ups."""
    lower = scaled.floor()
    return lower.add_(noise.lt_(scaled.sub_(lower)))
