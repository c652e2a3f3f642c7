"""Tensors that are whole rows of one stacked tensor, so that what is computed once per tensor can
be computed once over the stack.

A vectorised cohort (:mod:`fedweave.cohort.vectorised`) trains its clients' parameters stacked,
one client per leading index, and gives each client's update the rows of the group's change: the
round's 100 updates of a tensor are then 100 views of one ``[100, ...]`` tensor. Their finiteness
is read as one sum per row of that tensor (:func:`finite_rows`) instead of a hundred small ones
(~10x faster for the digits MLP's weights on a CPU): a yes or no for each, whatever the memory it
lies in. (Their weighted average is not taken over the stack: one product over its rows would sum
in another order than over the same updates trained elsewhere, and its bits would depend on how the
clients were grouped, :func:`fedweave.strategies.aggregate.weighted_average`.) Any other tensor
(the sequential loop's, a decoded or filtered update's) is no row of a stack and is read on its own.
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
