"""``fedweave status RUN_DIR``: where a run stands, from its files only (a run going on
elsewhere, on a shared disk): progress, accuracy, time so far and an ETA from the mean
pace of its records so far.

The time so far is the run's wall time since it began, start-up included (docs/metrics.md,
Time): a finished run's is its last record's; a running run's adds the time since that record
was written (the metrics file's modification time), and before its first record it is the
time since its config was written, the first thing a run does."""

from __future__ import annotations

import time
from pathlib import Path

from fedweave.observe.compare import accuracies, progress
from fedweave.observe.figures import elapsed
from fedweave.observe.progress import remaining
from fedweave.observe.rundata import CONFIG_FILE, METRICS_FILE, MODEL_FILES, RunData, load_run


def fraction_done(run: RunData) -> float | None:
    """Share of the run done: rounds or steps of the plan, else epochs (data-parallel by epochs)."""
    if not run.records:
        return 0.0
    last = run.records[-1]
    if run.planned:
        return min(last[run.axis] / run.planned, 1.0)
    epochs = (run.config.get("data_parallel") or {}).get("epochs")
    if run.data_parallel and epochs and last.get("epoch") is not None:
        return min(last["epoch"] / epochs, 1.0)
    return None


def finished(run_dir: str | Path) -> bool:
    """Whether the run in ``run_dir`` is finished: its model written and its metrics at its last
    round or step (or, data-parallel by epochs, its last epoch)."""
    path = Path(run_dir)
    if not any((path / name).is_file() for name in MODEL_FILES):
        return False
    try:
        run = load_run(path)
    except FileNotFoundError:
        return False
    done = fraction_done(run)
    return done is not None and done >= 1


def time_so_far(run: RunData, now: float) -> float | None:
    """Seconds since the run began (the module's doc says how); None without a config's time."""
    wall = elapsed(run.records, run.data_parallel)
    done = fraction_done(run)
    if wall and done is not None and done >= 1:
        return wall[-1]
    metrics, config = Path(run.path) / METRICS_FILE, Path(run.path) / CONFIG_FILE
    if wall and metrics.is_file():
        return wall[-1] + max(now - metrics.stat().st_mtime, 0.0)
    return max(now - config.stat().st_mtime, 0.0) if config.is_file() else None


def eta(run: RunData) -> float | None:
    """Seconds left at the pace so far (None before the first record or without a plan)."""
    done = fraction_done(run)
    wall = elapsed(run.records, run.data_parallel)
    return remaining(wall[-1], done) if done and wall else None


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m{rest % 60:02d}s" if hours else f"{rest // 60}m{rest % 60:02d}s"


def status_rows(run: RunData, now: float | None = None) -> list[tuple[str, str]]:
    """The rows ``fedweave status`` prints."""
    now = time.time() if now is None else now
    done = fraction_done(run)
    rows = [("run", run.name), ("mode", "data-parallel" if run.data_parallel else "federated"),
            ("progress", progress(run) + ("" if done is None else f" ({100 * done:.0f} %)"))]
    accs = accuracies(run)
    if accs:
        at, _, acc = accs[-1]
        rows.append(("test accuracy", f"{acc:.4f} ({run.axis} {at})"))
        best = max(accs, key=lambda a: a[2])
        rows.append(("best test accuracy", f"{best[2]:.4f} ({run.axis} {best[0]})"))
    so_far = time_so_far(run, now)
    if so_far is not None:
        rows.append(("time so far", f"{_duration(so_far)} since the run began"))
    metrics = Path(run.path) / METRICS_FILE
    if done is not None and done >= 1:
        rows.append(("state", "finished"))
    else:
        left = eta(run)
        rows.append(("ETA", "-" if left is None else f"{_duration(left)} at the pace so far"))
        if metrics.is_file():
            rows.append(("last record", f"{_duration(max(now - metrics.stat().st_mtime, 0))} ago"))
    rows += [("note", note) for note in run.notes]
    return rows
