"""``metrics.jsonl``: one JSON object per round, appended as rounds end.

Each line is written whole by one write and flushed to the operating system, which keeps it
through a killed process; it is synced to disk with the round's checkpoint (``sync``), so
a resumed run finds every round its checkpoint covers even after a machine crash. A process
killed in the middle of that write can still leave a torn last line: the reader drops it
with a warning (the resumed run writes that round again). A bad line anywhere else is an
error naming its line number.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from fedweave.errors import CheckpointError
from fedweave.files import atomic_write_text

log = logging.getLogger(__name__)


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsWriter:
    def __init__(self, path: str | Path):
        self.path = Path(path)

    def append(self, record: dict[str, Any], sync: bool = True) -> None:
        """Append ``record`` as one line; ``sync``: then fsync the file (every line so far on disk)."""
        line = (json.dumps({k: _clean(v) for k, v in record.items()}) + "\n").encode()
        with self.path.open("ab") as f:
            f.write(line)
            f.flush()
            if sync:
                os.fsync(f.fileno())

    def truncate_after(self, last: int, key: str = "round") -> None:
        """Drop records whose ``key`` (round, or step) is after ``last`` (those a resumed run will redo)."""
        kept = [r for r in read_metrics(self.path) if r[key] <= last]
        atomic_write_text("".join(json.dumps(r) + "\n" for r in kept), self.path)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of ``path`` (none when it does not exist), without a torn last line."""
    path = Path(path)
    if not path.exists():
        return []
    numbered = [(n, line) for n, line in enumerate(path.read_bytes().splitlines(), 1) if line.strip()]
    records = []
    for n, line in numbered:
        try:
            record = json.loads(line)
        except ValueError:  # also bytes that are not UTF-8
            record = None
        if isinstance(record, dict):
            records.append(record)
        elif n == numbered[-1][0]:
            log.warning("metrics file %s: dropped its torn last line %d (a write was interrupted)", path, n)
        else:
            raise CheckpointError(f"metrics file {str(path)!r} line {n}: not a JSON record; the file is corrupted")
    return records
