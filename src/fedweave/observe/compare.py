"""The summary table of one or several runs: final and best test accuracy, time to a
target accuracy, bytes moved, wall time and how far each run got; and of groups of runs
(one config, several seeds: :mod:`fedweave.observe.groups`) the mean ± std of the same."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from fedweave.observe.figures import elapsed
from fedweave.observe.groups import Spread, group_runs, lower_is_better, spread
from fedweave.observe.rundata import RunData


@dataclass
class Summary:
    run: str
    mode: str
    progress: str
    final_accuracy: float | None
    best_accuracy: float | None
    time_to_target: float | None  # seconds until the test accuracy first reached the target
    reached_at: int | None  # the round or step where it did
    bytes: int | None  # sent + received by the server (federated)
    wall_time: float | None


def default_target(runs: Sequence[RunData]) -> float | None:
    """The best accuracy the weakest run reached (every run reaches it), floored to 0.01."""
    bests = [b for b in (best_accuracy(r) for r in runs) if b is not None]
    return math.floor(round(min(bests) * 100, 6)) / 100 if bests else None


def accuracies(run: RunData) -> list[tuple[int, float, float]]:
    """(round or step, seconds since the start, test accuracy) of each evaluated record."""
    wall = elapsed(run.records, run.data_parallel)
    return [(r[run.axis], t, r["test_accuracy"]) for r, t in zip(run.records, wall)
            if r.get("test_accuracy") is not None]


def best_accuracy(run: RunData) -> float | None:
    accs = [a for _, _, a in accuracies(run)]
    return max(accs) if accs else None


def progress(run: RunData) -> str:
    """``3/20 rounds``, ``step 120 (epoch 2.00 of 3)``; a run short of its plan says so."""
    if not run.records:
        return "no records yet"
    last = run.records[-1]
    if run.data_parallel:
        epochs = (run.config.get("data_parallel") or {}).get("epochs")
        text = f"step {last['step']}"
        if last.get("epoch") is not None and epochs and not run.planned:
            text += f" (epoch {last['epoch']:.2f} of {epochs})"
        elif run.planned:
            text += f" of {run.planned}"
        return text
    return f"{last['round']}/{run.planned} rounds" if run.planned else f"{last['round']} rounds"


def summarize(run: RunData, target: float | None) -> Summary:
    accs = accuracies(run)
    hit = next(((at, t) for at, t, a in accs if target is not None and a >= target), None)
    wall = elapsed(run.records, run.data_parallel)
    sent = [r.get("bytes_sent") for r in run.records]
    received = [r.get("bytes_received") for r in run.records]
    moved = sum(b or 0 for b in sent + received) if any(b is not None for b in sent + received) else None
    return Summary(
        run=run.name,
        mode="data-parallel" if run.data_parallel else "federated",
        progress=progress(run),
        final_accuracy=accs[-1][2] if accs else None,
        best_accuracy=max(a for _, _, a in accs) if accs else None,
        time_to_target=hit[1] if hit else None,
        reached_at=hit[0] if hit else None,
        bytes=moved,
        wall_time=wall[-1] if wall else None,
    )


def summaries(runs: Sequence[RunData], target: float | None = None) -> tuple[float | None, list[Summary]]:
    """The target used (``target``, else :func:`default_target`) and each run's summary."""
    target = default_target(runs) if target is None else target
    return target, [summarize(r, target) for r in runs]


SUMMARIZED = ("test_accuracy", "test_loss", "federated_accuracy")
"""The metrics whose final and best values a group summary gives, where its runs record them."""


def values(run: RunData, metric: str) -> list[tuple[float, float]]:
    """(seconds since the start, value) of each record where ``metric`` has a value."""
    wall = elapsed(run.records, run.data_parallel)
    return [(t, r[metric]) for r, t in zip(run.records, wall) if isinstance(r.get(metric), (int, float))]


def best(metric: str, found: list[float]) -> float:
    return min(found) if lower_is_better(metric) else max(found)


def time_to(run: RunData, metric: str, target: float) -> float | None:
    """Seconds from the start until ``metric`` first reached ``target`` (at most, for a loss)."""
    low = lower_is_better(metric)
    return next((t for t, v in values(run, metric) if (v <= target if low else v >= target)), None)


@dataclass
class GroupSummary:
    """One group's runs (a grid point's seeds): per metric the spread of the final and of the best
    values, the time to the target (of the runs that reached it) and the wall time."""

    label: str
    runs: list[str]
    progress: list[str]
    final: dict[str, Spread]
    best: dict[str, Spread]
    target: tuple[str, float] | None
    time_to_target: Spread | None
    reached: int  # how many of the runs reached the target
    wall_time: Spread | None


def group_summaries(runs: Sequence[RunData], target: tuple[str, float] | None = None) -> list[GroupSummary]:
    """The :class:`GroupSummary` of each group of ``runs``."""
    out = []
    for group in group_runs(runs):
        metrics = [m for m in dict.fromkeys([*SUMMARIZED, *([target[0]] if target else [])])
                   if any(values(r, m) for r in group.runs)]
        per_run = {m: [[v for _, v in values(r, m)] for r in group.runs] for m in metrics}
        final = {m: spread([vs[-1] for vs in found if vs]) for m, found in per_run.items()}
        bests = {m: spread([best(m, vs) for vs in found if vs]) for m, found in per_run.items()}
        times = [time_to(r, *target) for r in group.runs] if target else []
        walls = [elapsed(r.records, r.data_parallel) for r in group.runs]
        out.append(GroupSummary(
            label=group.label,
            runs=[r.name for r in group.runs],
            progress=[progress(r) for r in group.runs],
            final={m: s for m, s in final.items() if s is not None},
            best={m: s for m, s in bests.items() if s is not None},
            target=target,
            time_to_target=spread(times),
            reached=sum(t is not None for t in times),
            wall_time=spread([w[-1] for w in walls if w]),
        ))
    return out


def group_table(rows: Sequence[GroupSummary]) -> list[list[str]]:
    """The summary as rows of text, a header first: per group its runs, mean ± std of the final and
    best value of each metric, the time to the target and the wall time."""
    metrics = list(dict.fromkeys(m for g in rows for m in g.final))
    target = next((g.target for g in rows if g.target), None)
    head = ["config", "runs", *(f"{w} {m}" for m in metrics for w in ("final", "best"))]
    if target:
        head.append(f"time to {target[0]} {'<=' if lower_is_better(target[0]) else '>='} {target[1]:g}")
    head.append("wall time (s)")
    table = [head]
    for g in rows:
        row = [g.label, str(len(g.runs))]
        for m in metrics:
            row += [_text(g.final.get(m)), _text(g.best.get(m))]
        if target:
            row.append("-" if g.time_to_target is None else
                       f"{g.time_to_target.text('.2f')} s ({g.reached}/{len(g.runs)})")
        row.append(_text(g.wall_time, ".2f"))
        table.append(row)
    return table


def _text(value: Spread | None, spec: str = ".4f") -> str:
    return "-" if value is None else value.text(spec)


def format_table(table: Sequence[Sequence[str]]) -> str:
    """Rows of text as aligned columns, the first row a header underlined."""
    widths = [max(len(row[k]) for row in table) for k in range(len(table[0]))]
    lines = ["  ".join(c.ljust(w) if k == 0 else c.rjust(w) for k, (c, w) in enumerate(zip(row, widths)))
             for row in table]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])
