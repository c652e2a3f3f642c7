"""Several runs' figures on one page, as a paper draws them.

Runs are grouped (:mod:`fedweave.observe.groups`: one config, several seeds). A shared figure
has, per group and series, one line: a group of one run draws the run's values as they are; a
group of several draws their mean at each round or step with a band around it, the range
(``band="range"``: min to max) or ``band="std"`` (mean ± the sample standard deviation). The
points of a time axis are matched by their round or step, the mean of the runs' times their x.
A line is labelled by its group (what differs between the configs) and, where a figure has
several series, the series' name (``strategy=fedprox: test accuracy``).

Per-run figures are drawn once per run, titled with the run's name; the partition is drawn once
for all the runs that share it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import replace

from fedweave.observe.figures import Figure, Series, run_figures
from fedweave.observe.groups import Group, group_runs
from fedweave.observe.rundata import RunData

BANDS = ("range", "std")


def mean_series(label: str, group: str, members: Sequence[Series], band: str) -> Series:
    """The mean of ``members`` (one series each of several runs) at each round or step, with a band."""
    if len(members) == 1:
        return replace(members[0], label=label, group=group)
    by_at: dict[float, list[tuple[float, float]]] = {}
    for s in members:
        for at, x, y in zip(s.at if s.at is not None else s.x, s.x, s.y):
            by_at.setdefault(at, []).append((x, y))
    ats = sorted(by_at)
    xs, ys, lows, highs = [], [], [], []
    for at in ats:
        pts = by_at[at]
        values = [y for _, y in pts]
        mean = statistics.fmean(values)
        xs.append(statistics.fmean(x for x, _ in pts))
        ys.append(mean)
        if band == "std":
            std = statistics.stdev(values) if len(values) > 1 else 0.0
            lows.append(mean - std)
            highs.append(mean + std)
        else:
            lows.append(min(values))
            highs.append(max(values))
    points_at = ats if members[0].at is not None else None
    return Series(label, xs, ys, at=points_at, group=group, low=lows, high=highs, runs=len(members))


def _group_figure(group: Group, figures: list[Figure], band: str) -> list[Series]:
    names = list(dict.fromkeys(s.label for f in figures for s in f.series))
    out = []
    for name in names:
        members = [s for f in figures for s in f.series if s.label == name]
        out.append(mean_series(f"{group.label}: {name}", group.label, members, band))
    return out


def partition_figures(runs: Sequence[RunData], figures: dict[int, list[Figure]]) -> list[Figure]:
    """Each distinct partition once, titled with the runs it belongs to (all of them: said so)."""
    distinct: list[tuple[Figure, list[str]]] = []
    for k, run in enumerate(runs):
        for fig in figures[k]:
            if fig.id != "partition":
                continue
            same = next((d for d in distinct if d[0].matrix == fig.matrix), None)
            if same is None:
                distinct.append((fig, [run.name]))
            else:
                same[1].append(run.name)
    out = []
    for n, (fig, names) in enumerate(distinct):
        whose = f"shared by all {len(runs)} runs" if len(names) == len(runs) else ", ".join(names)
        fid = "partition" if len(distinct) == 1 else f"partition-{n + 1}"
        out.append(replace(fig, id=fid, title=f"{fig.title} — {whose}"))
    return out


def combine(runs: Sequence[RunData], band: str = "range") -> list[Figure]:
    """The figures of ``runs``: shared ones with a line (and band) per group, per-run ones once per
    run, the partition once per distinct one. A single run's are its own."""
    if band not in BANDS:
        raise ValueError(f"band {band!r}: one of {', '.join(BANDS)}")
    if len(runs) == 1:
        return run_figures(runs[0])
    index = {id(r): k for k, r in enumerate(runs)}
    figures = {k: run_figures(r) for k, r in enumerate(runs)}
    shared: dict[str, Figure] = {}
    own: list[Figure] = []
    for group in group_runs(runs):
        per_id: dict[str, list[Figure]] = {}
        for run in group.runs:
            k = index[id(run)]
            for fig in figures[k]:
                if fig.id == "partition":
                    continue
                if fig.per_run:
                    own.append(replace(fig, id=f"{fig.id}-{k + 1}", title=f"{run.name}: {fig.title}"))
                else:
                    per_id.setdefault(fig.id, []).append(fig)
        for fid, figs in per_id.items():
            series = _group_figure(group, figs, band)
            marks = [(x, f"{group.label}: {what}") for f in figs for x, what in f.marks]
            if fid in shared:
                shared[fid].series += series
                shared[fid].marks += marks
            else:
                shared[fid] = replace(figs[0], series=series, marks=marks)
    return [*shared.values(), *own, *partition_figures(runs, figures)]
