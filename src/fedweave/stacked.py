"""Tensors that are whole rows of one stacked tensor, so that what is computed once per tensor can
be computed once over the stack.

A vectorised cohort (:mod:`fedweave.cohort.vectorised`) trains its clients' parameters stacked,
one client per leading index, and gives each client's update the rows of the group's change: the
round's 100 updates of a tensor are then 100 views of one ``[100, ...]`` tensor. Reading them as
that one tensor (their finiteness, their weighted sum) is one operation over contiguous memory
instead of a hundred small ones (~10x faster for the digits MLP's weights on a CPU). Any other
tensor (the sequential loop's, a decoded or filtered update's) is no row of a stack and is read
on its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


Stacks = dict[int, tuple[torch.Tensor, int, int, torch.dtype]]
"""What :func:`row_of` has read of each tensor it met as a stack, by identity: the tensor, its
storage offset (-1: not contiguous, no stack of rows), its elements and its dtype."""


def row_of(tensor: torch.Tensor, stacks: Stacks | None = None) -> tuple[torch.Tensor, int] | None:
    """The contiguous tensor ``tensor`` is a view of (``tensor._base``), read as a stack of rows of
    ``tensor``'s size, and the index of ``tensor``'s row in it; None when ``tensor`` is no such row
    (not a view, not contiguous, or not at a row's offset). ``stacks`` keeps what was read of each
    stack for the next tensor (a hundred rows of one stack: the stack read once)."""
    base = tensor._base
    if base is None:
        return None
    known = None if stacks is None else stacks.get(id(base))
    if known is None:
        known = (base, int(base.storage_offset()) if base.is_contiguous() else -1, base.numel(), base.dtype)
        if stacks is not None:
            stacks[id(base)] = known
    _, start, elements, dtype = known
    size = tensor.numel()
    if start < 0 or not size or elements % size or tensor.dtype != dtype or not tensor.is_contiguous():
        return None
    row, rest = divmod(int(tensor.storage_offset()) - start, size)
    return (base, row) if not rest and 0 <= row < elements // size else None


def rows_view(stack: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """``stack`` as its rows of ``tensor``'s size, one per line: ``[rows, size]``."""
    return stack.view(-1, tensor.numel())


def stacked_rows(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[int]] | None:
    """The one stack every tensor of ``tensors`` is a row of (:func:`row_of`), each of the same
    shape, and their rows in order, or None (fewer than two tensors, or one that is not such a row)."""
    if len(tensors) < 2:
        return None
    stacks: Stacks = {}
    shape = tensors[0].shape
    first = row_of(tensors[0], stacks)
    if first is None:
        return None
    base, rows = first[0], [first[1]]
    for tensor in tensors[1:]:
        found = row_of(tensor, stacks)
        if found is None or found[0] is not base or tensor.shape != shape:
            return None
        rows.append(found[1])
    return base, rows


def finite_rows(tensors: Sequence[torch.Tensor]) -> set[tuple[int, int]]:
    """Of ``tensors``, those found free of NaN and infinities by one sum per row of the stacks they
    are rows of (:func:`row_of`; a finite sum clears a row, as :func:`fedweave.federated.checks.finite`
    reads it), each as ``(id, version)``: the tensor, unchanged since (an in-place edit moves its
    version). A tensor that is no row of a floating stack, or whose row's sum is not finite (NaN,
    infinity, or an overflow of finite values), is not among them: it is for the caller to read."""
    by_stack: dict[tuple[int, int], tuple[torch.Tensor, list[tuple[torch.Tensor, int]]]] = {}
    stacks: Stacks = {}
    for tensor in tensors:
        found = row_of(tensor, stacks)
        if found is not None and found[0].is_floating_point():
            by_stack.setdefault((id(found[0]), tensor.numel()), (found[0], []))[1].append((tensor, found[1]))
    cleared: set[tuple[int, int]] = set()
    for stack, rows in by_stack.values():
        if len(rows) < 2:
            continue
        finite = rows_view(stack, rows[0][0]).sum(1).isfinite().tolist()
        cleared.update((id(tensor), tensor._version) for tensor, row in rows if finite[row])
    return cleared


def weighted_rows_sum(tensors: Sequence[torch.Tensor], coefficients: Sequence[float], dtype: torch.dtype) -> torch.Tensor | None:
    """``Σ c_i · t_i`` in ``dtype`` as one product over the stack that all of ``tensors`` are rows
    of, or None when they are not rows of one stack."""
    found = stacked_rows(tensors)
    if found is None:
        return None
    stack, rows = found
    lines = rows_view(stack, tensors[0])
    if sorted(rows) == list(range(lines.shape[0])):  # every row once, in any order: the weights follow the rows
        ordered = [0.0] * len(rows)
        for row, c in zip(rows, coefficients):
            ordered[row] = c
        weights = torch.tensor(ordered, dtype=dtype)
    else:  # some rows, or some twice: those rows, gathered
        lines = lines.index_select(0, torch.tensor(rows, device=stack.device))
        weights = torch.tensor(coefficients, dtype=dtype)
    return (weights.to(stack.device) @ lines.to(dtype)).view(tensors[0].shape)
