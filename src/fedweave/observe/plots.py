"""Report plots (PNG). matplotlib is imported here only, with its Agg backend, and only
when a plot is drawn."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

PANELS = (("batch", "batch size (samples)"), ("compute_time", "compute time (s/step)"), ("idle_time", "idle time (s/step)"))


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
    """Per-worker batch size, compute time and idle time per step against the step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    path = Path(path)
    fig, axes = plt.subplots(len(PANELS), 1, figsize=(8, 7), sharex=True)
    try:
        for ax, (key, label) in zip(axes, PANELS):
            for worker, (steps, values) in sorted(worker_series(records, key).items()):
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
