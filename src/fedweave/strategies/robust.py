"""Aggregation rules: how the clients' tensors are combined into one.

``mean`` is the example-weighted average every averaging strategy starts from. The
others resist a minority of Byzantine clients (arbitrary, possibly malicious updates):

- ``median``: the coordinate-wise median (even counts: the mean of the two middle values);
- ``trimmed_mean``: per coordinate, drop the ⌊β·n⌋ smallest and largest values and
  average the rest (Yin et al., ICML 2018, https://arxiv.org/abs/1803.01498);
- ``krum`` / ``multi_krum``: score each update by its squared distances to its n − f − 2
  nearest neighbours, keep the best one (Krum) or the best m and average them
  (Blanchard et al., NeurIPS 2017, https://arxiv.org/abs/1703.02757).

Median and trimmed mean ignore the weights: a client's claimed example count would
otherwise let it pull every coordinate. Multi-Krum averages the updates it selects by
their weights, so with m = n (and f = 0) it is the weighted mean. (Multi-)Krum discards
the other updates whole and returns a :class:`~fedweave.strategies.aggregate.Selected`
naming the kept ones, so their clients' rounds count as applied and only theirs; the
median and trimmed mean let every update move some coordinates, so all count. Integer tensors are
counters and take the element-wise maximum, as in :func:`~fedweave.strategies.aggregate.weighted_average`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from fedweave.errors import RoundError
from fedweave.strategies.aggregate import Selected, weighted_average
from fedweave.strategies.base import Average
from fedweave.types import Params


class RuleSettings(Protocol):
    """What an aggregation rule is built from: the config's ``aggregation`` section gives it, read
    where the strategy's context is built (:func:`fedweave.build.build_strategy`)."""

    @property
    def rule(self) -> str: ...

    @property
    def trim_fraction(self) -> float: ...

    @property
    def byzantine(self) -> int: ...

    @property
    def multi_krum_m(self) -> int | None: ...


def averager(config: RuleSettings) -> Average:
    """The combine function named by ``config.rule``, for :attr:`StrategyContext.average
    <fedweave.strategies.base.StrategyContext.average>`."""
    if config.rule == "mean":
        return weighted_average
    if config.rule == "median":
        return coordinate_median
    if config.rule == "trimmed_mean":
        return functools.partial(trimmed_mean, fraction=config.trim_fraction)
    if config.rule == "krum":
        return functools.partial(multi_krum, byzantine=config.byzantine, select=1)
    if config.rule == "multi_krum":
        return functools.partial(multi_krum, byzantine=config.byzantine, select=config.multi_krum_m)
    raise ValueError(f"unknown aggregation rule {config.rule!r}")


def coordinate_median(tensors: Sequence[Params], weights: Sequence[float]) -> Params:
    """The coordinate-wise median of every floating tensor (weights are ignored)."""

    def median(values: torch.Tensor) -> torch.Tensor:
        n = values.shape[0]
        middle = values.sort(dim=0).values[(n - 1) // 2 : n // 2 + 1]
        return middle.mean(dim=0)

    return _per_coordinate(tensors, weights, median)


def trimmed_mean(tensors: Sequence[Params], weights: Sequence[float], *, fraction: float) -> Params:
    """Per coordinate, the mean of the values left after dropping ⌊fraction·n⌋ at each end."""
    if not 0 <= fraction < 0.5:
        raise ValueError(f"trim fraction must lie in [0, 0.5), got {fraction}")

    def mean(values: torch.Tensor) -> torch.Tensor:
        n = values.shape[0]
        k = int(fraction * n)
        return values.sort(dim=0).values[k : n - k].mean(dim=0)

    return _per_coordinate(tensors, weights, mean)


def krum_scores(tensors: Sequence[Params], byzantine: int) -> torch.Tensor:
    """Each update's sum of squared distances to its n − f − 2 nearest others (all floats flattened)."""
    n = len(tensors)
    if n <= 2 * byzantine + 2:
        raise RoundError(
            f"Krum with aggregation.byzantine={byzantine} needs more than 2f + 2 = {2 * byzantine + 2} "
            f"updates, this round has {n}: lower aggregation.byzantine or sample more clients"
        )
    flat = torch.stack(
        [torch.cat([t.flatten().double() for t in ts.values() if t.is_floating_point()]) for ts in tensors]
    )
    distances = torch.cdist(flat, flat, compute_mode="donot_use_mm_for_euclid_dist") ** 2
    distances.fill_diagonal_(float("inf"))
    return distances.sort(dim=1).values[:, : n - byzantine - 2].sum(dim=1)


def multi_krum(
    tensors: Sequence[Params], weights: Sequence[float], *, byzantine: int, select: int | None
) -> Selected:
    """The weighted mean of the ``select`` updates of lowest Krum score (None: n − f; 1: Krum),
    naming them (summed in their input order; ties in score keep the earlier input)."""
    _check(tensors, weights)
    n = len(tensors)
    m = n - byzantine if select is None else select
    if not 1 <= m <= n:
        raise RoundError(f"Multi-Krum selects m={m} updates, but this round has {n}: set aggregation.multi_krum_m")
    chosen = sorted(torch.sort(krum_scores(tensors, byzantine), stable=True).indices[:m].tolist())
    return Selected(weighted_average([tensors[i] for i in chosen], [weights[i] for i in chosen]), chosen)


def _per_coordinate(
    tensors: Sequence[Params], weights: Sequence[float], combine: Callable[[torch.Tensor], torch.Tensor]
) -> Params:
    """``combine`` over the client axis of every floating tensor; element-wise max for integer ones."""
    _check(tensors, weights)
    out: Params = {}
    for name, first in tensors[0].items():
        if first.is_floating_point():
            dtype = torch.promote_types(first.dtype, torch.float32)
            out[name] = combine(torch.stack([t[name].to(dtype) for t in tensors])).to(first.dtype)
        else:
            out[name] = torch.stack([t[name] for t in tensors]).amax(dim=0)
    return out


def _check(tensors: Sequence[Params], weights: Sequence[float]) -> None:
    if not tensors:
        raise ValueError("aggregation needs at least one set of tensors")
    if len(tensors) != len(weights):
        raise ValueError(f"{len(tensors)} tensor sets but {len(weights)} weights")
