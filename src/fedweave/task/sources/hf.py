"""A Hugging Face ``datasets`` folder written by ``save_to_disk`` (extra ``files``); a
``DatasetDict`` folder gives its ``split``. Image columns come as arrays (H, W[, C])."""

from __future__ import annotations

from fedweave.errors import TaskError
from fedweave.task.sources.table import Columns, column_array


def read(path: str, *, split: str = "train") -> Columns:
    try:
        import datasets
    except ImportError as exc:
        raise TaskError("format hf needs the datasets package: pip install 'fedweave[files]'") from exc
    loaded = datasets.load_from_disk(path)
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise TaskError(f"task.dataset_options.split: {path} has no split '{split}'; it has {', '.join(loaded)}")
        loaded = loaded[split]
    columns = loaded.with_format("numpy")[:]
    return {name: column_array(values, path, name) for name, values in columns.items()}
