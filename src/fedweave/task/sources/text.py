"""Plain text: one file, or every file below a folder whose name matches a glob; one row per file
(its ``text`` and its ``file``, relative to the folder), files in sorted order."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedweave.errors import TaskError
from fedweave.task.sources.table import Columns


def read(path: str, pattern: str = "*") -> Columns:
    root = Path(path)
    files = [root] if root.is_file() else sorted(p for p in root.rglob(pattern) if p.is_file())
    if not files:
        raise TaskError(f"task.dataset_options.pattern: {path} has no file matching {pattern!r}")
    texts = []
    for file in files:
        try:
            texts.append(file.read_text(encoding="utf-8"))
        except UnicodeDecodeError as exc:
            raise TaskError(f"{file}: not UTF-8 text (byte {exc.start})") from None
    names = [file.name if file == root else str(file.relative_to(root)) for file in files]
    return {"text": np.asarray(texts, dtype=object), "file": np.asarray(names, dtype=object)}
