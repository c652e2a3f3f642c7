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


def rows_in(stack: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[int | None]:
    """For each of ``tensors``, views of ``stack``, the index of its row when it is a whole row of
    ``stack`` read as rows of its size (contiguous, as many elements, its first element at a row's
    address in ``stack``'s memory), else None.
    ``stack`` is read once, each tensor with a few cheap calls: a cohort's hundred rows at once.

    A row is found by its address, not by its storage offset: a view whose base was since pointed
    at other memory (``base.set_(...)``, ``base.data = ...``) keeps its old storage, and its offset
    would name a row of memory it does not hold. A view that reads its memory otherwise than as it
    lies (a lazily negated or conjugated view) is no row either."""
    if not stack.is_contiguous() or stack.is_neg() or stack.is_conj():
        return [None] * len(tensors)
    start, elements, dtype, device = stack.data_ptr(), stack.numel(), stack.dtype, stack.device
    itemsize = stack.element_size()
    complex_ = stack.is_complex()  # only a complex tensor has a conjugate bit
    out: list[int | None] = []
    for tensor in tensors:
        size = tensor.numel()
        if (not size or elements % size or tensor.dtype != dtype
                or (tensor._base is not stack and tensor.device != device)  # a view of stack shares its memory
                or not tensor.is_contiguous() or tensor.is_neg() or (complex_ and tensor.is_conj())):
            out.append(None)
            continue
        row, rest = divmod(tensor.data_ptr() - start, size * itemsize)
        out.append(row if not rest and 0 <= row < elements // size else None)
    return out


def rows_view(stack: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """``stack`` as its rows of ``tensor``'s size, one per line: ``[rows, size]``."""
    return stack.view(-1, tensor.numel())


def stacked_rows(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[int]] | None:
    """The one stack every tensor of ``tensors`` is a row of (:func:`rows_in`), each of the same
    shape, and their rows in order, or None (fewer than two tensors, or one that is not such a row)."""
    if len(tensors) < 2:
        return None
    base, shape = tensors[0]._base, tensors[0].shape
    if base is None or any(t._base is not base or t.shape != shape for t in tensors):
        return None
    rows = rows_in(base, tensors)
    return None if None in rows else (base, rows)  # type: ignore[return-value]


def finite_rows(tensors: Sequence[torch.Tensor]) -> dict[tuple[int, int], torch.Tensor]:
    """Of ``tensors``, those found free of NaN and infinities by one sum per row of the stacks they
    are rows of (:func:`rows_in`; a finite sum clears a row, as :func:`fedweave.federated.checks.finite`
    reads it), each by ``(id, version)``: the tensor, unchanged since (an in-place edit moves its
    version). Each key maps to its tensor, which the mapping keeps alive: a caller matches a tensor
    by ``cleared.get((id(t), t._version)) is t``, so that another tensor that came to have a freed
    one's id is never taken for it. A tensor that is no row of a floating stack, or whose row's sum
    is not finite (NaN, infinity, or an overflow of finite values), or whose stack cannot be read so,
    is not among them: it is for the caller to read."""
    by_stack: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
    for tensor in tensors:
        base = tensor._base
        if base is not None:
            found = by_stack.get(id(base))
            if found is None:
                found = by_stack[id(base)] = (base, [])
            found[1].append(tensor)
    cleared: dict[tuple[int, int], torch.Tensor] = {}
    for stack, views in by_stack.values():
        if len(views) < 2 or not stack.is_floating_point():
            continue
        try:
            sums: dict[int, list[bool]] = {}  # per row size: each row's sum finite
            for tensor, row in zip(views, rows_in(stack, views)):
                if row is None:
                    continue
                size = tensor.numel()
                finite = sums.get(size)
                if finite is None:
                    finite = sums[size] = rows_view(stack, tensor).sum(1).isfinite().tolist()
                if finite[row]:
                    cleared[(id(tensor), tensor._version)] = tensor
        except Exception:  # a stack that cannot be read so (a meta tensor's): its views are read one by one
            continue
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
