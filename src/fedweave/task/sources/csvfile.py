"""CSV with a header row: one column per field, numbers or strings."""

from __future__ import annotations

import csv

from fedweave.errors import TaskError
from fedweave.task.sources.table import Columns, column_array


def read(path: str) -> Columns:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if not rows:
        raise TaskError(f"{path}: empty CSV, expected a header row")
    header, body = rows[0], rows[1:]
    if len(set(header)) != len(header):
        raise TaskError(f"{path}: the header names a column twice: {header}")
    for i, row in enumerate(body):
        if len(row) != len(header):
            raise TaskError(f"{path}: line {i + 2} has {len(row)} fields, the header {len(header)}")
    return {name: column_array([row[j] for row in body], path, name) for j, name in enumerate(header)}
