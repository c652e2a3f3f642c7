"""The tensors of one payload cut into buckets, all as the rows of one matrix.

QSGD and int8 quantize each bucket of ``size`` entries with its own norm or scale. A
tensor is zero-padded to whole buckets, so each bucket belongs to one tensor; laying
the buckets of every tensor of an update out as the rows of one matrix lets a codec
quantize the whole update in a few passes of torch kernels, where one pass per tensor
would pay the same fixed cost for a 10-entry bias as for the 100,000-entry weight. The
random draws stay those of each tensor's own generator, row range by row range, so the
encoding of every tensor is the one it would have had on its own.

The layout of a list of tensor sizes is built once (:func:`layout`): a federation
quantizes the same model's tensors round after round. Fields that never left the
process (views of the encoder's matrix: int8 values, 8- and 16-bit QSGD levels, norms and
scales) are decoded where they lie (:meth:`Buckets.joined`), without gathering them into
a new matrix first.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence

import torch

ONE = torch.tensor(1.0)


class Buckets:
    """Where each of a list of tensors lies in the matrix of their buckets."""

    def __init__(self, numels: Sequence[int], size: int):
        self.size = size
        self.numels = list(numels)
        self.rows = [-(-n // size) for n in self.numels]
        self.total = sum(self.rows)
        # where each tensor's entries, and its values per bucket, start in the flattened matrix and column
        self.row_starts = [0, *itertools.accumulate(self.rows)][: len(self.rows)]
        self.starts = [size * start for start in self.row_starts]
        # the rows that end in padding: each padded tensor's last
        last = [start + rows - 1 for n, rows, start in zip(self.numels, self.rows, self.row_starts) if n % size]
        self.padding_rows = torch.tensor(last, dtype=torch.int64) if last else None

    def matrix(
        self, tensors: Sequence[torch.Tensor], what: str = "values", padded: bool = True, magnitudes: bool = False
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A new float32 ``(buckets, size)`` matrix of ``tensors``' entries (their absolute
        values with ``magnitudes``), each tensor zero-padded to whole buckets (``padded``;
        else the padding is left as it comes: for a result only read through its entries),
        and the views of each tensor's entries in it, in the tensor's shape. ``ValueError``
        when a tensor does not hold its number of entries."""
        for tensor, n in zip(tensors, self.numels):
            if tensor.numel() != n:
                raise ValueError(f"{what} hold {tensor.numel()} entries, the layout {n}")
        out = torch.empty(self.total, self.size, dtype=torch.float32)
        if padded and self.padding_rows is not None:  # zeros, then the entries written over them
            out.index_fill_(0, self.padding_rows, 0.0)
        entries = self.entries(out, [tuple(tensor.shape) for tensor in tensors])
        for tensor, piece in zip(tensors, entries):
            if magnitudes:
                torch.abs(tensor, out=piece)
            else:
                piece.copy_(tensor)
        return out, entries

    def column(self, per_bucket: Sequence[torch.Tensor], what: str) -> torch.Tensor:
        """One value per bucket of each tensor (a norm, a scale), as a float32 ``(buckets, 1)`` column."""
        for values, rows in zip(per_bucket, self.rows):
            if values.numel() != rows:
                raise ValueError(f"{what} hold {values.numel()} entries, the layout's buckets are {rows}")
        out = torch.empty(self.total, 1, dtype=torch.float32)
        return torch.cat([v.reshape(-1) for v in per_bucket], out=out.view(-1)).view(-1, 1)

    def draws(self, seeds: Sequence[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """Uniform [0, 1) noise of the matrix's shape (into ``out``, a float32 matrix of
        it, when given): each tensor's rows the numbers ``torch.rand((rows, size),
        generator=torch.Generator().manual_seed(seed))`` draws with its own seed (one
        generator, seeded afresh for each tensor: seeding resets all of its state)."""
        noise = torch.empty(self.total, self.size, dtype=torch.float32) if out is None else out
        generator = torch.Generator()
        for seed, rows in zip(seeds, noise.split(self.rows)):
            rows.uniform_(generator=generator.manual_seed(seed))
        return noise

    def joined(self, tensors: Sequence[torch.Tensor], per_bucket: bool = False) -> torch.Tensor | None:
        """The ``(buckets, size)`` matrix (``(buckets, 1)`` column with ``per_bucket``) of
        which ``tensors`` are the entries (the values per bucket), as a view, when they are
        views of one buffer at the places this layout gives them: what :meth:`entries` and
        :meth:`per_bucket` of one matrix return, as a codec's fields are when they never
        left the process. Else None. Its padding holds whatever the buffer holds there,
        so it is read through the entries only."""
        if not tensors:
            return None
        starts, width, numels = (self.row_starts, 1, self.rows) if per_bucket else (self.starts, self.size, self.numels)
        first = tensors[0]
        base = first.storage_offset()
        ptr = first.untyped_storage().data_ptr()
        for tensor, start, n in zip(tensors, starts, numels):
            if (
                tensor.numel() != n
                or tensor.dtype != first.dtype
                or not tensor.is_contiguous()
                or tensor.storage_offset() != base + start
                or tensor.untyped_storage().data_ptr() != ptr
            ):
                return None
        if (base + self.total * width) * first.element_size() > first.untyped_storage().nbytes():
            return None
        return first.as_strided((self.total, width), (width, 1), base)

    def entries(self, flat: torch.Tensor, shapes: Sequence[tuple[int, ...]] | None = None) -> list[torch.Tensor]:
        """Each tensor's entries of the matrix ``flat`` (contiguous, or flattened), padding
        left out: views, flat or of ``shapes``. (One ``as_strided`` per tensor: a split and a view
        of each piece cost twice the calls, ~5 us each with the caches cold after training.)"""
        base = flat.storage_offset()
        shapes = [(n,) for n in self.numels] if shapes is None else shapes
        return [flat.as_strided(shape, _strides(shape), base + start) for shape, start in zip(shapes, self.starts)]

    def per_bucket(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Each tensor's part of one value per bucket of ``values`` (a contiguous vector or column; views)."""
        base = values.storage_offset()
        return [values.as_strided((rows,), (1,), base + start) for rows, start in zip(self.rows, self.row_starts)]


@functools.lru_cache(maxsize=256)
def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))


@functools.lru_cache(maxsize=64)
def layout(numels: tuple[int, ...], size: int) -> Buckets:
    """The :class:`Buckets` of tensors of ``numels`` entries, built once per layout."""
    return Buckets(numels, size)


def nonzero(values: torch.Tensor, low: float | None = None) -> torch.Tensor:
    """``values`` (norms or scales, none negative) with 1 wherever one is not positive
    (0, or NaN): each bucket's divisor, so that a bucket of zeros stays zeros. ``values``
    itself when all are positive (the usual case: its minimum, ``low`` when the caller has
    it, costs half a ``where`` with the caches cold after training)."""
    if (float(values.min()) if low is None else low) > 0:
        return values
    return torch.where(values > 0, values, ONE)


def products(
    buckets: Buckets, values: Sequence[torch.Tensor], per_bucket: Sequence[torch.Tensor], what: str, whats: str
) -> torch.Tensor:
    """A new float32 ``(buckets, size)`` matrix: each tensor's entries ``values`` (float32,
    or integers, converted exactly) times its buckets' values ``per_bucket`` (float32),
    one rounding each. ``ValueError`` when a tensor does not hold its number of entries
    (``what``) or buckets (``whats``). Integer fields that never left the process are read
    where they lie (:meth:`Buckets.joined`), others gathered into a matrix first: float32
    ones are gathered even then, since ``.to(float32)`` of them is the fields themselves,
    which the product would overwrite."""
    column = buckets.joined(per_bucket, per_bucket=True)
    if column is None or column.dtype != torch.float32:
        column = buckets.column(per_bucket, whats)
    rows = buckets.joined(values)
    if rows is None or rows.is_floating_point():
        return buckets.matrix(values, what, padded=False)[0].mul_(column)
    return rows.to(torch.float32).mul_(column)


def stochastic_round(scaled: torch.Tensor, noise: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``scaled`` rounded down or up at random, up where ``noise`` (uniform in [0, 1)) is
    below its fractional part (unbiased): ``floor(v) + (u < v - floor(v))`` (the
    difference exact for v >= 0). Into ``out`` (which may be ``scaled``) or a
    new tensor; ``scaled`` holds its fractional part afterwards, ``noise`` the ups."""
    lower = scaled.floor()
    noise.lt_(scaled.sub_(lower))
    return torch.add(lower, noise, out=out) if out is not None else lower.add_(noise)
