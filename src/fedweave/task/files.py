"""``task.dataset: files``: each site's own data read from files (see :mod:`fedweave.task.sources`).

In a simulation ``path`` is one file partitioned across the clients, or a template whose
``{client}`` gives each client its own file. Every file read is checked against the federation's
:class:`~fedweave.task.schema.DataSchema` (``input_shape`` and ``num_classes`` when declared, else
the first training file's shape and the largest label read). The central test set is
``test_path`` alone: without it the server holds no test data.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from fedweave.errors import TaskError
from fedweave.task.datasets import Dataset
from fedweave.task.schema import DataSchema, check_data
from fedweave.task.sources import (
    FEATURE_DEFAULTS,
    LABEL_DEFAULTS,
    FileOptions,
    Samples,
    class_ids,
    infer_format,
    read_columns,
    select,
)

logger = logging.getLogger(__name__)

KEY = "task.dataset_options"


@dataclass(frozen=True, eq=False)
class FileData:
    """The files of a run read into one :class:`Dataset`, with what the partition needs."""

    dataset: Dataset
    schema: DataSchema
    parts: list[np.ndarray] | None
    """Each client's rows of ``dataset.x_train`` when each reads its own file (a ``{client}`` path)."""
    groups: np.ndarray | None
    """The ``task.partition.by`` value (LEAF: the user) of each training row, when asked for."""


def load_files(options: FileOptions, *, clients: int, by: str | None = None, natural: bool = False) -> FileData:
    """Read the training files (one, or ``clients`` from the template) and ``test_path``; with
    ``natural`` keep each training row's ``by`` value (LEAF's default: its user) for the partition."""
    first = options.path_of(0) if options.template else options.path
    fmt = options.format or infer_format(first, f"{KEY}.path")
    if natural and by is None:
        if fmt != "leaf":
            raise TaskError(f"task.partition.by: scheme natural needs the column whose values are the clients of {first}")
        by = "user"
    label = options.label or LABEL_DEFAULTS[fmt]
    features = options.features or FEATURE_DEFAULTS.get(fmt)
    paths = [options.path_of(c) for c in range(clients)] if options.template else [options.path]

    def read(path: str, key: str, group: str | None) -> Samples:
        return select(read_columns(path, fmt, key, split=options.split), path, label, features, group)

    train = [read(p, f"{KEY}.path", by) for p in paths]
    test = read(options.test_path, f"{KEY}.test_path", None) if options.test_path else None
    every = [*train, *([test] if test else [])]
    classes = options.classes
    if classes is None and any(s.labels.dtype.kind == "U" for s in every):
        classes = sorted({name for s in every if s.labels.dtype.kind == "U" for name in s.labels.tolist()})
        logger.info("%s.classes: the label names read, sorted: %s", KEY, classes)
    ids = [class_ids(s, classes) for s in every]
    num_classes = options.num_classes or (len(classes) if classes else 1 + max(int(y.max(initial=0)) for y in ids))
    shape = tuple(options.input_shape) if options.input_shape else tuple(int(d) for d in train[0].x.shape[1:])
    schema = DataSchema(shape, num_classes)
    for samples, y in zip(every, ids):
        check_data(samples.path, samples.x, y, schema)
    x_train = np.concatenate([s.x for s in train])
    y_train = np.concatenate(ids[: len(train)])
    offsets = np.cumsum([0, *(len(s.x) for s in train)])
    parts = [np.arange(a, b, dtype=np.int64) for a, b in zip(offsets[:-1], offsets[1:])] if options.template else None
    if test is None:
        x_test, y_test = np.empty((0, *shape), dtype=np.float32), np.empty(0, dtype=np.int64)
    else:
        x_test, y_test = test.x, ids[-1]
    dataset = Dataset(
        name="files",
        x_train=torch.from_numpy(x_train),
        y_train=torch.from_numpy(y_train),
        x_test=torch.from_numpy(x_test),
        y_test=torch.from_numpy(y_test),
        num_classes=num_classes,
        input_shape=shape,
    )
    logger.info(
        "dataset files (%s): %d train rows from %d file(s), %d test rows, %d classes, input %s",
        fmt, len(y_train), len(train), len(y_test), num_classes, shape,
    )
    return FileData(dataset, schema, parts, train[0].groups if natural else None)
