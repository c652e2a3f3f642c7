"""Runs grouped as a paper groups them: the runs whose configs differ only in their seed are one
group (a grid point of a sweep), and each group is named by what differs between the groups'
configs (``strategy=fedprox, local.lr=0.1``), not by folder names.

A config is compared as its dotted leaf keys; the keys that name or place a run (``seed``,
``name``, ``output_dir``) are left out, and so are the keys some configs lack when a key they all
have differs (fedprox's ``strategy.mu`` follows from ``strategy.name``); where no key they all
have differs, a group is named by the keys its config has that differ between the configs having
them, else by the keys only it has. A key ``X.name`` is shown
as ``X`` (``strategy.name`` reads ``strategy``)."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fedweave.observe.rundata import RunData

PLACES_A_RUN = ("seed", "name", "output_dir")
"""Config keys that say where a run is and which draw it is, not what it is."""

LONGEST_LABEL = 80
"""A label by differences longer than this falls back to the runs' names."""


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted leaf keys of a nested mapping; lists are leaves."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, f"{dotted}."))
        else:
            out[dotted] = value
    return out


def identity(config: Mapping[str, Any]) -> dict[str, Any]:
    """What a run is: its flattened config without the keys that place it or draw its seed."""
    return {k: v for k, v in flatten(config).items() if k not in PLACES_A_RUN}


def shown_key(key: str) -> str:
    return key[: -len(".name")] if key.endswith(".name") else key


def shown_value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


@dataclass
class Group:
    """Runs of one config but their seeds; ``label`` says what sets the group apart from the others."""

    label: str
    runs: list[RunData]

    @property
    def seeds(self) -> list[Any]:
        return [r.config.get("seed") for r in self.runs]


def group_runs(runs: Sequence[RunData]) -> list[Group]:
    """``runs`` grouped by config but the seed, in the order of each group's first run."""
    keyed: dict[str, list[RunData]] = {}
    identities: dict[str, dict[str, Any]] = {}
    for run in runs:
        ident = identity(run.config)
        key = json.dumps(ident, sort_keys=True, default=str)
        keyed.setdefault(key, []).append(run)
        identities[key] = ident
    idents = list(identities.values())
    keys = list(dict.fromkeys(k for ident in idents for k in ident))
    differing = [k for k in keys if _differs(k, idents)]
    everywhere = [k for k in differing if all(k in i for i in idents)]  # a key only some configs have
    groups = []                                                           # follows from a choice (fedprox's mu)
    for key, members in keyed.items():
        ident = identities[key]
        having = [k for k in differing if k in ident]
        shown = everywhere or [k for k in having if _differs(k, [i for i in idents if k in i])] or having
        label = ", ".join(f"{shown_key(k)}={shown_value(ident[k])}" for k in shown)
        if not label or len(label) > LONGEST_LABEL:
            label = ", ".join(dict.fromkeys(r.name for r in members))
        groups.append(Group(label, members))
    return groups


def _differs(key: str, idents: Sequence[Mapping[str, Any]]) -> bool:
    return len({json.dumps(i.get(key), sort_keys=True, default=str) for i in idents}) > 1


@dataclass
class Spread:
    """The mean, the sample standard deviation (0 for one value) and the range of several runs' values."""

    mean: float
    std: float
    low: float
    high: float
    n: int

    def text(self, spec: str = ".4f") -> str:
        if self.n == 1:
            return format(self.mean, spec)
        return f"{format(self.mean, spec)} ± {format(self.std, spec)}"


def spread(values: Sequence[float | None]) -> Spread | None:
    """The :class:`Spread` of the finite values (None when there are none)."""
    kept = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not kept:
        return None
    std = statistics.stdev(kept) if len(kept) > 1 else 0.0
    return Spread(statistics.fmean(kept), std, min(kept), max(kept), len(kept))


def lower_is_better(metric: str) -> bool:
    """A loss (or an error, a time) is better low; anything else (an accuracy) high."""
    return any(word in metric for word in ("loss", "error", "time"))
