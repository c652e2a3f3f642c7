"""JSON Lines: one object per line, the same fields in each; a field may hold a (nested) list."""

from __future__ import annotations

import json

from fedweave.errors import TaskError
from fedweave.task.sources.table import Columns, column_array


def read(path: str) -> Columns:
    records: list[dict[str, object]] = []
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TaskError(f"{path}: line {number} is not JSON: {exc.msg}") from exc
            if not isinstance(record, dict) or (records and record.keys() != records[0].keys()):
                raise TaskError(f"{path}: line {number} is not an object with the first line's fields")
            records.append(record)
    if not records:
        raise TaskError(f"{path}: no records")
    return {name: column_array([r[name] for r in records], path, name) for name in records[0]}
