"""Terminal output of a run: a one-line progress bar and the final summary table."""

from __future__ import annotations

import time
from typing import Any, TextIO


def _fmt(value: Any, spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)


def remaining(elapsed: float, fraction: float) -> float | None:
    """Seconds left at the pace so far: ``fraction`` of the work took ``elapsed`` seconds."""
    return elapsed * (1 - fraction) / fraction if fraction > 0 else None


def eta_text(elapsed: float, fraction: float) -> str:
    """`` ETA 12.3s`` while work is left (nothing once it is done or before any)."""
    left = remaining(elapsed, fraction)
    return "" if left is None or fraction >= 1 else f" ETA {left:.1f}s"


def share_done(record: dict[str, Any], steps: int | None, epochs: int) -> float:
    """Share of a data-parallel run done at ``record``: of its steps when it counts steps, else of its epochs."""
    return min(record["step"] / steps if steps else record["epoch"] / epochs, 1.0)


class ProgressBar:
    """Redraws one line per round on a terminal; prints a line per round elsewhere. The ETA
    is at the pace of the rounds it has seen (from its creation to the last one)."""

    def __init__(self, total: int, stream: TextIO, start_round: int = 0, width: int = 24):
        self.total = total
        self.stream = stream
        self.width = width
        self.done = start_round
        self.before: int | None = None  # the round before the first one seen (a resumed run's start)
        self.started = time.perf_counter()
        self.tty = stream.isatty()

    def update(self, record: dict[str, Any]) -> None:
        self.done = record["round"]
        self.before = self.done - 1 if self.before is None else self.before
        elapsed = time.perf_counter() - self.started
        filled = int(self.width * self.done / self.total)
        bar = "#" * filled + "." * (self.width - filled)
        acc = record.get("test_accuracy")
        text = (
            f"round {self.done:>{len(str(self.total))}}/{self.total} [{bar}] "
            f"loss {_fmt(record.get('train_loss'))} acc {_fmt(acc)} "
            f"clients {record['clients_completed']}/{record['clients_sampled']} "
            f"{elapsed:.1f}s"
            + eta_text(elapsed, (self.done - self.before) / max(self.total - self.before, 1))
        )
        if self.tty:
            end = "\n" if self.done >= self.total else ""
            self.stream.write("\r" + text + end)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()


def summary_table(rows: list[tuple[str, str]]) -> str:
    """A two-column box of ``(label, value)`` rows."""
    left = max(len(k) for k, _ in rows)
    right = max(len(v) for _, v in rows)
    line = "+" + "-" * (left + 2) + "+" + "-" * (right + 2) + "+"
    body = [f"| {k:<{left}} | {v:>{right}} |" for k, v in rows]
    return "\n".join([line, *body, line])


def run_summary(records: list[dict[str, Any]], run_dir: str, elapsed: float) -> list[tuple[str, str]]:
    """The rows of the final summary of a run; its wall time is the last record's ``elapsed`` (start-up
    included, docs/metrics.md), else ``elapsed``."""
    last = records[-1]
    accs = [r["test_accuracy"] for r in records if r.get("test_accuracy") is not None]
    rows = [
        ("rounds", str(last["round"])),
        ("final test accuracy", _fmt(last.get("test_accuracy"))),
        ("best test accuracy", _fmt(max(accs) if accs else None)),
        ("final test loss", _fmt(last.get("test_loss"))),
    ]
    fed = [r for r in records if r.get("federated_accuracy") is not None]
    if fed:
        rows.append(("federated accuracy (local splits)", _fmt(fed[-1]["federated_accuracy"])))
    sent = sum(r["bytes_sent"] for r in records)
    received = sum(r["bytes_received"] for r in records)
    eps = [r["epsilon"] for r in records if r.get("epsilon") is not None]
    if eps:
        rows.append(("privacy ε (at the plugin's δ)", f"{eps[-1]:.3f}"))
    rows += [
        ("data sent / received", f"{sent / 1e6:.1f} MB / {received / 1e6:.1f} MB"),
        ("wall time (since the run began)", f"{last.get('elapsed', elapsed):.1f} s"),
        ("run directory", run_dir),
    ]
    return rows
