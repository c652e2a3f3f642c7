"""Report plots (PNG). matplotlib is imported here only, with its Agg backend, and only
when a plot is drawn."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

PANELS = (("batch", "batch size (samples)"), ("compute_time", "compute time (s/step)"), ("idle_time", "idle time (s/step)"))
ASYNC_PANELS = (("updates", "updates per window"), ("staleness", "staleness (server steps)"))
"""Drawn when the records have them (``data_parallel.sync: asp``)."""


def worker_series(records: Sequence[dict[str, Any]], key: str) -> dict[int, tuple[list[float], list[float]]]:
    """Per worker id: (steps, values) of the per-worker list ``key`` of each record."""
    series: dict[int, tuple[list[float], list[float]]] = {}
    for record in records:
        for worker, value in zip(record.get("workers", []), record.get(key) or []):
            steps, values = series.setdefault(int(worker), ([], []))
            steps.append(record["step"])
            values.append(value)
    return series


def plot_workers(records: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Per-worker batch size, compute time and idle time per step (with asp also updates and
    staleness) against the step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    path = Path(path)
    series = {key: worker_series(records, key) for key, _ in PANELS + ASYNC_PANELS}
    panels = PANELS + tuple(panel for panel in ASYNC_PANELS if series[panel[0]])
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 7 * len(panels) / len(PANELS)), sharex=True)
    try:
        for ax, (key, label) in zip(axes, panels):
            for worker, (steps, values) in sorted(series[key].items()):
                ax.plot(steps, values, marker=".", label=f"worker {worker}")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        axes[0].legend(loc="best", fontsize="small")
        axes[-1].set_xlabel("step")
        axes[0].set_title("data-parallel workers (means over each metrics window)")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return path


CLIENT_PANELS = (("compute", "compute time (s)"), ("idle", "idle time (s)"), ("staleness", "staleness (server steps)"))


def client_series(records: Sequence[dict[str, Any]], key: str) -> dict[int, tuple[list[float], list[float]]]:
    """Per client id: (rounds, values) of ``key`` in the per-client entries (``clients``) of each record."""
    series: dict[int, tuple[list[float], list[float]]] = {}
    for record in records:
        for entry in record.get("clients") or []:
            if entry.get(key) is not None:
                rounds, values = series.setdefault(int(entry["id"]), ([], []))
                rounds.append(record["round"])
                values.append(entry[key])
    return series


def plot_clients(records: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Per-client local work (steps x batch, in samples), compute time and idle time (or, with
    asynchronous aggregation, staleness) against the round, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.ticker import MaxNLocator

    path = Path(path)
    batches = client_series(records, "batch")
    work = {
        cid: (rounds, [s * b for s, b in zip(steps, batches[cid][1])])
        for cid, (rounds, steps) in client_series(records, "steps").items()
    }
    panels = [("work", "local steps x batch", work)] + [
        (key, label, series) for key, label in CLIENT_PANELS if (series := client_series(records, key))
    ]
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.4 * len(panels)), sharex=True, squeeze=False)
    try:
        for ax, (_, label, series) in zip(axes[:, 0], panels):
            for cid, (rounds, values) in sorted(series.items()):
                ax.plot(rounds, values, marker=".", label=f"client {cid}")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        if 0 < len(work) <= 12:
            axes[0, 0].legend(loc="best", fontsize="small", ncol=2)
        axes[-1, 0].set_xlabel("round")
        axes[-1, 0].xaxis.set_major_locator(MaxNLocator(integer=True))
        axes[0, 0].set_title("federated clients per round")
        fig.subplots_adjust(left=0.12, right=0.97, top=0.94, bottom=0.08, hspace=0.12)  # no layout pass: cheaper
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return path
