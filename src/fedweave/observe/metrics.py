"""``metrics.jsonl``: one JSON object per round, appended and flushed as rounds end."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from fedweave.checkpoint import atomic_write_text


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsWriter:
    def __init__(self, path: str | Path):
        self.path = Path(path)

    def append(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")

    def truncate_after(self, last: int, key: str = "round") -> None:
        """Drop records whose ``key`` (round, or step) is after ``last`` (those a resumed run will redo)."""
        kept = [r for r in read_metrics(self.path) if r[key] <= last]
        atomic_write_text("".join(json.dumps(r) + "\n" for r in kept), self.path)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
