"""The summary table of one or several runs: final and best test accuracy, time to a
target accuracy, bytes moved, wall time and how far each run got."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from fedweave.observe.figures import elapsed
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
