"""Pure aggregation math shared by strategies. No state, no I/O.

Floating-point tensors are averaged; integer tensors (``num_batches_tracked`` and the
like) are counters, never summed or averaged: they take the element-wise maximum.

A rule that discards whole inputs (Krum) says which it kept with :class:`Selected`, and a
server step built on it passes that on (:func:`apply_delta` and :func:`step_floats` do;
other steps call :func:`with_selection`), so the loop counts only
the kept updates as applied (:class:`fedweave.federated.rounds.AcceptedRounds`).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fedweave.schema import opt
from fedweave.types import Params, Update

RUNNING_STATISTICS = ("*running_mean", "*running_var")


def matches(name: str, patterns: Sequence[str]) -> bool:
    """Whether state-dict ``name`` matches any of the glob ``patterns``."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def plain_average_option(step: str) -> Any:
    """The ``plain_average`` setting of strategies whose server step is more than a mean.

    Running statistics take the clients' plain average instead of ``step``: a momentum
    or adaptive step applied to a variance can drive it below zero.
    """
    return opt(
        factory=lambda: list(RUNNING_STATISTICS),
        help=f"glob patterns of state-dict names set to the clients' average instead of taking the {step} "
        "(running statistics)",
    )


class Selected(dict[str, torch.Tensor]):
    """Tensors combined from only some of the inputs: those at the indices ``kept``, ascending.

    Params in every other respect. A rule that discards whole inputs (Krum) returns one;
    plain ``Params`` mean every input contributed (the mean, the median, the trimmed mean:
    every update moves some coordinates).
    """

    def __init__(self, tensors: Params, kept: Sequence[int]):
        super().__init__(tensors)
        self.kept = tuple(sorted(kept))


def kept_indices(combined: Params, count: int) -> list[int]:
    """The indices of the ``count`` inputs ``combined`` was made of: those a :class:`Selected` names, else all."""
    return list(combined.kept) if isinstance(combined, Selected) else list(range(count))


def discarded_clients(updates: Sequence[Update], kept: Sequence[int]) -> list[int]:
    """The clients behind the ``updates`` whose indices are not in ``kept``."""
    keep = set(kept)
    return [cid for i, u in enumerate(updates) if i not in keep for cid in u.senders]


def with_selection(source: Params, result: Params) -> Params:
    """``result``, computed from ``source``, naming the same kept inputs: a :class:`Selected` when ``source`` is one."""
    return Selected(result, source.kept) if isinstance(source, Selected) else result


def weighted_average(tensors: Sequence[Params], weights: Sequence[float]) -> Params:
    """Σ w_i · t_i / Σ w_i for every floating tensor, element-wise max for integer ones.

    The floating sums are accumulated one input after another, in the order given (one
    ``torch._foreach_add_`` per input over all its floating tensors), so that their bits depend on
    the inputs' values and order alone: not on where the tensors lie (a vectorised cohort's updates
    are rows of one stacked tensor, the same clients trained in other groups or worker processes
    are not), as a single product over a stack's rows would."""
    if not tensors:
        raise ValueError("weighted_average needs at least one set of tensors")
    if len(tensors) != len(weights):
        raise ValueError(f"{len(tensors)} tensor sets but {len(weights)} weights")
    total = float(sum(weights))
    if not total > 0:
        raise ValueError(f"weights must sum to a positive number, got {total}")
    first = tensors[0]
    floats = [name for name, t in first.items() if t.is_floating_point()]
    sums = [torch.zeros_like(first[name], dtype=torch.promote_types(first[name].dtype, torch.float32)) for name in floats]
    if floats:  # (foreach takes no empty list)
        for t, w in zip(tensors, weights):
            torch._foreach_add_(sums, [t[name] for name in floats], alpha=w / total)
    averaged = dict(zip(floats, sums))
    out: Params = {}
    for name, value in first.items():
        if name in averaged:
            out[name] = averaged[name].to(value.dtype)
        else:
            acc = value.clone()
            for t in tensors[1:]:
                acc = torch.maximum(acc, t[name])
            out[name] = acc
    return out


def apply_delta(params: Params, delta: Params, scale: float = 1.0) -> Params:
    """``params + scale · delta``; integer tensors of ``delta`` are values and replace them.
    Names the inputs ``delta`` kept (:func:`with_selection`)."""
    out: Params = {}
    for name, p in params.items():
        d = delta[name]
        out[name] = p + scale * d if p.is_floating_point() else d.clone()
    return with_selection(delta, out)


def step_floats(
    params: Params,
    delta: Params,
    plain_average: Sequence[str],
    step: Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor],
) -> Params:
    """New parameters from the mean client ``delta``: ``step(name, p, d)`` for each
    floating tensor, ``p + d`` for those matching ``plain_average``, and the value in
    ``delta`` for integer tensors (counters are never stepped). Names the inputs ``delta``
    kept (:func:`with_selection`)."""
    out: Params = {}
    for name, p in params.items():
        d = delta[name]
        if not p.is_floating_point():
            out[name] = d.clone()
        elif matches(name, plain_average):
            out[name] = p + d
        else:
            out[name] = step(name, p, d)
    return with_selection(delta, out)
