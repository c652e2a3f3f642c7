"""Apache Parquet, read with pyarrow (extra ``files``)."""

from __future__ import annotations

from fedweave.errors import TaskError
from fedweave.task.sources.table import Columns, column_array


def read(path: str) -> Columns:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise TaskError("format parquet needs pyarrow: pip install 'fedweave[files]'") from exc
    table = pq.read_table(path).to_pydict()
    return {name: column_array(values, path, name) for name, values in table.items()}
