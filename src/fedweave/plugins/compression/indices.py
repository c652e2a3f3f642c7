"""Sorted positions of a tensor's entries in 2 bytes each, as top-k sends them.

A position is stored as its offset within a block of 65,536 entries (int16, shifted by
−32,768), with one int32 count per block when the tensor has more than one block: about
half the bytes of int32 positions. The receiver checks the counts before it unpacks
(:func:`check_packed`) and the positions as it unpacks them (:func:`unpack_indices`),
since both come from a peer.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from fedweave.plugins.compression.wire import named

BLOCK = 1 << 16


def pack_indices(indices: torch.Tensor, numel: int) -> dict[str, torch.Tensor]:
    """Sorted flat positions in a tensor of ``numel`` entries, as fields ``indices`` (and,
    past one block, ``blocks``)."""
    positions = indices.numpy()
    if numel <= BLOCK:  # the offsets are the positions
        return {"indices": torch.from_numpy((positions - BLOCK // 2).astype(np.int16))}
    blocks = np.bincount(positions // BLOCK, minlength=-(-numel // BLOCK)).astype(np.int32)
    return {"indices": torch.from_numpy((positions % BLOCK - BLOCK // 2).astype(np.int16)), "blocks": torch.from_numpy(blocks)}


def check_packed(fields: dict[str, torch.Tensor], numel: int, k: int) -> None:
    """Raise ``ValueError`` unless ``fields`` can be :func:`pack_indices`' packing of ``k``
    positions in a tensor of ``numel`` entries: ``k`` offsets and, past one block, one count
    per block, none negative, summing to ``k``. O(blocks): the offsets are checked as they
    are unpacked (:func:`unpack_indices`)."""
    indices = named(fields, "indices")
    if indices.numel() != k:
        raise ValueError(f"'indices' hold {indices.numel()} positions, the layout's tensor sends {k}")
    blocks = -(-numel // BLOCK)
    if numel <= BLOCK:
        if "blocks" in fields:
            raise ValueError(f"'blocks' for a tensor of {numel} entries, which is one block")
        return
    counts = named(fields, "blocks")
    if counts.numel() != blocks:
        raise ValueError(f"'blocks' hold {counts.numel()} counts, the layout's tensor has {blocks} blocks")
    if int(counts.min()) < 0 or int(counts.sum(dtype=torch.int64)) != k:
        raise ValueError(f"'blocks' counts are negative or do not sum to the {k} positions")


def unpack_indices(fields: Sequence[dict[str, torch.Tensor]], numels: Sequence[int]) -> np.ndarray:
    """The positions :func:`pack_indices` packed for each of several tensors (their fields
    passed :func:`check_packed`), as positions in the tensors laid end to end: tensor i's
    are offset by the entries of the tensors before it. One pass over all of them, however
    many tensors. ``ValueError`` unless each tensor's are strictly increasing and below its
    ``numel``, as packed."""
    ends = list(itertools.accumulate(numels))
    sizes = [parts["indices"].numel() for parts in fields]
    starts: list[int] = []  # where each block begins in the tensors laid end to end
    counts: list[int] = []  # how many positions each block holds
    for parts, end, numel, size in zip(fields, ends, numels, sizes):
        begin = end - numel
        if "blocks" in parts:
            blocks = parts["blocks"]
            starts.extend(range(begin + BLOCK // 2, begin + BLOCK // 2 + BLOCK * blocks.numel(), BLOCK))
            counts.extend(blocks.tolist())
        else:
            starts.append(begin + BLOCK // 2)
            counts.append(size)
    positions = np.concatenate([parts["indices"].numpy() for parts in fields]).astype(np.int64)
    positions += np.repeat(np.array(starts, dtype=np.int64), counts)
    # increasing overall, and each tensor's last below its end: each tensor's within it, increasing
    # (and, the other way round, every tensor's so makes them so overall: the loop names the one)
    lasts = [last - 1 for last, size in zip(itertools.accumulate(sizes), sizes) if size]
    if positions.size and not (
        bool(np.all(positions[1:] > positions[:-1]))
        and bool(np.all(positions[lasts] < np.array([end for end, size in zip(ends, sizes) if size])))
    ):
        for mine, end, numel in zip(np.split(positions, list(itertools.accumulate(sizes))[:-1]), ends, numels):
            if mine.size and (mine[-1] >= end or not bool(np.all(mine[1:] > mine[:-1]))):
                raise ValueError(f"'indices' are not increasing positions below {numel}")
    return positions
