"""NumPy ``.npz``: one array per column (never unpickled)."""

from __future__ import annotations

import numpy as np

from fedweave.errors import TaskError
from fedweave.task.sources.table import Columns


def read(path: str) -> Columns:
    try:
        with np.load(path, allow_pickle=False) as archive:
            columns = {name: archive[name] for name in archive.files}
    except ValueError as exc:
        raise TaskError(f"{path}: not a plain .npz archive (object arrays are never unpickled): {exc}") from exc
    return {name: a.astype(str) if a.dtype.kind in "US" else a for name, a in columns.items()}
