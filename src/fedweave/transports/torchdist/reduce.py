"""Pre-aggregation by reduce: a site's plain updates summed as Σ n_k x_k per floating dtype
(accumulated in fp32, or fp64 for fp64 tensors) and their integer counters as a max, on the leader."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from fedweave.transports.torchdist.group import SiteGroup
from fedweave.types import Update


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def update_layout(update: Update) -> list[list[Any]]:
    return [
        [k, str(v.dtype).removeprefix("torch."), list(v.shape)]
        for k, v in sorted(update.tensors.items())
    ]


def reduce_update(
    site: SiteGroup, layout: list[list[Any]], updates: Sequence[Update], bucket: int
) -> dict[str, torch.Tensor]:
    """Σ n_k x_k (floats) and max x_k (integers) over the site's ``updates``, on the leader."""
    floats: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    ints: list[tuple[str, torch.Tensor]] = []
    for name, dtype_name, shape in layout:
        dtype = getattr(torch, dtype_name)
        if dtype.is_floating_point:
            acc = _accumulator(dtype)
            value = torch.zeros(shape, dtype=acc)
            for u in updates:
                value.add_(u.tensors[name].to(acc), alpha=u.num_examples)
            floats.setdefault(acc, []).append((name, value))
        else:
            low = torch.iinfo(torch.int64).min if dtype != torch.bool else 0
            value = torch.full(shape, low, dtype=torch.int64)
            for u in updates:
                value = torch.maximum(value, u.tensors[name].to(torch.int64))
            ints.append((name, value))
    out: dict[str, torch.Tensor] = {}
    for acc in sorted(floats, key=str):
        names = [n for n, _ in floats[acc]]
        out.update(
            zip(
                names,
                site.reduce_flat(
                    [t for _, t in floats[acc]], dist.ReduceOp.SUM, bucket
                ),
            )
        )
    out.update(
        zip(
            [n for n, _ in ints],
            site.reduce_flat([t for _, t in ints], dist.ReduceOp.MAX, bucket),
        )
    )
    return out
