"""The b_i / B weighting of the synchronous step, and flat vectors of parameters and buffers.

Worker i computes ∇ (b_i / B) · mean loss over its b_i samples; summed over the
workers (one all-reduce) these shares are exactly the gradient of the mean loss over
the concatenated batch of B samples. A world-size mean (what DDP does) would weight a
worker's samples by 1/n instead, which is wrong as soon as the b_i differ.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import nn

from fedweave.training import LossFn


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def float_buffers(model: nn.Module) -> list[torch.Tensor]:
    """Floating buffers (BatchNorm running statistics): averaged like the gradients."""
    return [b for b in model.buffers() if b.is_floating_point()]


def local_contribution(
    model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, weight: float
) -> tuple[torch.Tensor, float]:
    """This worker's share of the global-batch gradient: ∇ (weight · mean loss on (x, y)),
    flattened; ``weight`` = b_i / B. Also the weighted loss (its share of the batch mean).

    Summed over workers these shares are exactly the gradient of the mean loss over
    the concatenated batch.
    """
    params = trainable(model)
    for p in params:
        p.grad = None
    if len(y) == 0:
        return torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device), 0.0
    loss = loss_fn(model(x), y) * weight
    loss.backward()
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
    return flat, float(loss.detach())


def _pieces(tensors: Iterable[torch.Tensor], flat: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each tensor with its consecutive slice of ``flat``, shaped like it (a view)."""
    offset = 0
    for t in tensors:
        yield t, flat[offset : offset + t.numel()].view_as(t)
        offset += t.numel()


def assign_gradient(model: nn.Module, flat: torch.Tensor) -> None:
    """Set each parameter's ``grad`` from one flat vector (the summed contributions)."""
    for p, piece in _pieces(trainable(model), flat):
        p.grad = piece.clone()


def copy_flat(tensors: Iterable[torch.Tensor], flat: torch.Tensor, add: bool = False) -> None:
    """Copy (``add``: add) consecutive slices of one flat vector into ``tensors``, in place."""
    with torch.no_grad():
        for t, piece in _pieces(tensors, flat):
            if add:
                t.add_(piece.to(t.dtype))
            else:
                t.copy_(piece)


def summed_gradient(
    model: nn.Module, loss_fn: LossFn, xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor]
) -> torch.Tensor:
    """Σ_i ∇ (b_i / B) · mean loss of chunk i: what the all-reduce computes, in one process."""
    total = sum(len(y) for y in ys)
    return torch.stack([local_contribution(model, loss_fn, x, y, len(y) / total)[0] for x, y in zip(xs, ys)]).sum(0)


def refused_shares(
    norms: Sequence[float], weights: Sequence[float], max_norm: float | None, max_ratio: float | None
) -> dict[int, str]:
    """By rank, why a member's share of a step's gradient may not be applied: its norm
    (``norms``, of the share b_i / B · g_i) is not finite, or its mean gradient's norm
    (norm / weight b_i / B) is above ``max_norm`` or above ``max_ratio`` times the lower median
    of the members' (``data_parallel.max_grad_norm``, ``data_parallel.max_norm_ratio``; None: no
    such bound). A member with no samples (weight 0) is judged by finiteness alone."""
    refused = {rank: f"its gradient's norm is {norm}" for rank, norm in enumerate(norms) if not math.isfinite(norm)}
    mean = {r: n / w for r, (n, w) in enumerate(zip(norms, weights)) if w > 0 and r not in refused}
    if max_norm is not None:
        refused.update({r: f"its mean gradient's norm {n:.4g} is above max_grad_norm {max_norm:g}"
                        for r, n in mean.items() if n > max_norm})
    if max_ratio is not None and mean:
        median = sorted(mean.values())[(len(mean) - 1) // 2]
        refused.update({
            r: f"its mean gradient's norm {n:.4g} is above max_norm_ratio {max_ratio:g} x the median {median:.4g}"
            for r, n in mean.items() if r not in refused and n > max_ratio * median
        })
    return dict(sorted(refused.items()))
