"""Readers of a site's data files, one module per format, each a ``read(path)`` returning its
columns (``name -> array`` with one row per sample); :mod:`.table` turns columns into features
and labels. Readers that need a heavy library (pyarrow, ``datasets``, PIL) import it when used."""

from __future__ import annotations

import importlib
import os

from fedweave.errors import TaskError
from fedweave.task.sources.options import FEATURE_DEFAULTS, FORMATS, LABEL_DEFAULTS, FileOptions
from fedweave.task.sources.table import Columns, Samples, class_ids, column_array, select, targets

MODULES = {
    "csv": "csvfile",
    "parquet": "parquet",
    "npz": "npz",
    "jsonl": "jsonl",
    "imagefolder": "imagefolder",
    "leaf": "leaf",
    "hf": "hf",
    "text": "text",
}
"""The module of :mod:`fedweave.task.sources` that reads each format."""

SUFFIXES = {".csv": "csv", ".parquet": "parquet", ".npz": "npz", ".jsonl": "jsonl", ".json": "leaf", ".txt": "text"}

__all__ = [
    "FEATURE_DEFAULTS",
    "FORMATS",
    "LABEL_DEFAULTS",
    "Columns",
    "FileOptions",
    "Samples",
    "class_ids",
    "column_array",
    "infer_format",
    "read_columns",
    "select",
    "targets",
]


def infer_format(path: str, key: str) -> str:
    """The format of ``path``: from a file's suffix; a folder holding ``dataset_info.json`` is hf,
    one of ``.json`` files leaf, one of sub-folders imagefolder. ``key`` names the option in errors."""
    if os.path.isfile(path):
        found = SUFFIXES.get(os.path.splitext(path)[1].lower())
    elif os.path.isdir(path):
        entries = os.listdir(path)
        if "dataset_info.json" in entries or "dataset_dict.json" in entries:
            found = "hf"
        elif any(e.endswith(".json") for e in entries):
            found = "leaf"
        elif any(os.path.isdir(os.path.join(path, e)) for e in entries):
            found = "imagefolder"
        else:
            found = None
    else:
        raise TaskError(f"{key}: no such file or folder: {path}")
    if found is None:
        raise TaskError(f"task.dataset_options.format: cannot tell the format of {path}; give one of {', '.join(FORMATS)}")
    return found


def read_columns(path: str, fmt: str, key: str, *, split: str = "train", pattern: str = "*") -> Columns:
    """The columns of ``path`` read as ``fmt`` (hf: its ``split``; text: a folder's files matching
    ``pattern``); a missing path is one line naming ``key`` and the file."""
    if not os.path.exists(path):
        raise TaskError(f"{key}: no such file or folder: {path}")
    reader = importlib.import_module(f"fedweave.task.sources.{MODULES[fmt]}")
    if fmt == "hf":
        return reader.read(path, split=split)
    if fmt == "text":
        return reader.read(path, pattern)
    return reader.read(path)
