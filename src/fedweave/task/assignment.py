"""``task.partition.scheme: from_file``: a JSON map from client id to the training rows it holds.

The file is ``{"0": [row, ...], "1": [...], ...}`` (or a list of such lists, client i at
place i): every client 0..clients-1 named once, rows whole numbers in range, none twice within a
client, and none held by two clients unless ``task.partition.allow_overlap``. Rows no client
names are left unused.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from fedweave.errors import ConfigError

KEY = "task.partition.file"


def read_assignment(path: str, rows: int, num_clients: int, *, allow_overlap: bool, min_samples: int) -> list[np.ndarray]:
    """Client i's rows (int64) of a training set of ``rows`` rows, read from ``path`` and checked."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError as exc:
        raise ConfigError(f"{KEY}: no such file: {path}") from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{KEY}: {path} is not JSON: {exc.msg} (line {exc.lineno})") from exc
    return check_assignment(data, path, rows, num_clients, allow_overlap=allow_overlap, min_samples=min_samples)


def check_assignment(
    data: Any, path: str, rows: int, num_clients: int, *, allow_overlap: bool, min_samples: int
) -> list[np.ndarray]:
    """``data`` (the parsed file) as each client's rows; a problem is one line naming ``path``."""
    if isinstance(data, list):
        data = {str(i): v for i, v in enumerate(data)}
    if not isinstance(data, dict):
        raise ConfigError(f"{KEY}: {path} must map client ids to lists of rows")
    expected = [str(i) for i in range(num_clients)]
    if sorted(data, key=lambda k: (len(k), k)) != expected:
        raise ConfigError(f"{KEY}: {path} names clients {sorted(data)[:5]}..., expected exactly 0..{num_clients - 1}")
    parts = []
    for client in expected:
        values = data[client]
        if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise ConfigError(f"{KEY}: {path}: client {client}'s rows must be a list of integers")
        part = np.asarray(values, dtype=np.int64)
        if part.size and (part.min() < 0 or part.max() >= rows):
            bad = int(part[(part < 0) | (part >= rows)][0])
            raise ConfigError(f"{KEY}: {path}: client {client} names row {bad}, outside 0..{rows - 1}")
        if len(np.unique(part)) != len(part):
            raise ConfigError(f"{KEY}: {path}: client {client} names a row twice")
        if len(part) < min_samples:
            raise ConfigError(f"{KEY}: {path}: client {client} has {len(part)} rows < task.partition.min_samples {min_samples}")
        parts.append(part)
    if not allow_overlap:
        everything = np.concatenate(parts)
        values, counts = np.unique(everything, return_counts=True)
        if (counts > 1).any():
            raise ConfigError(
                f"{KEY}: {path}: row {int(values[counts > 1][0])} belongs to two clients; "
                "set task.partition.allow_overlap: true if that is meant"
            )
    return parts
