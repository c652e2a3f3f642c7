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
from fedweave.task.corpus import load_text
from fedweave.task.datasets import Dataset
from fedweave.task.schema import LABEL_KINDS, DataSchema, check_data
from fedweave.task.sources import (
    FEATURE_DEFAULTS,
    LABEL_DEFAULTS,
    FileOptions,
    Samples,
    class_ids,
    infer_format,
    read_columns,
    select,
    targets,
)
from fedweave.task.tokenize import Blocks

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


def simulation_paths(options: FileOptions, clients: int) -> list[str]:
    """The training files of a simulation: each client's from the template, or the one ``path``."""
    if options.path is None:
        raise TaskError(
            f"{KEY}.path: a simulation reads the clients' data from path (a deployed client gives its own --data)"
        )
    return [options.path_of(c) for c in range(clients)] if options.template else [options.path]


def load_files(
    options: FileOptions,
    paths: list[str],
    *,
    test: bool = True,
    by: str | None = None,
    natural: bool = False,
    deployed: bool = False,
    kind: str = "classification",
    text: Blocks | None = None,
) -> FileData:
    """Read the training files ``paths`` (each client's, or one to partition) and, with ``test``,
    ``test_path``; with ``natural`` keep each training row's ``by`` value (LEAF's default: its user).
    ``deployed``: this process reads part of the federation's data only, so the model's classes
    (``num_classes`` or ``classes``) and, reading no file, ``input_shape`` must be declared. A task of
    ``kind`` regression or multilabel reads float targets, its outputs are its label columns; a
    ``language_model`` reads text into the token blocks ``text`` says (:mod:`fedweave.task.corpus`)."""
    if kind == "language_model":
        if natural:
            raise TaskError("task.partition.scheme: text has no column to split by; give each client its files "
                            f"with {{client}} in {KEY}.path")
        assert text is not None  # a language model's caller says how its text becomes blocks
        dataset, schema, parts = load_text(options, paths, text, test=test)
        return FileData(dataset, schema, parts, None)
    test_path = options.test_path if test else None
    first = paths[0] if paths else test_path
    fmt = options.format or (infer_format(first, f"{KEY}.path" if paths else f"{KEY}.test_path") if first else None)
    label = options.label or LABEL_DEFAULTS.get(fmt or "")
    if first is not None and label is None:
        raise TaskError(f"{KEY}.label: format {fmt} needs the label column's name")
    if natural and by is None:
        if fmt != "leaf":
            raise TaskError(f"task.partition.by: scheme natural needs the column whose values are the clients of {first}")
        by = "user"
    classifies = kind == "classification"
    if classifies and deployed and options.num_classes is None and options.classes is None:
        raise TaskError(
            f"{KEY}.num_classes: a deployed node reads only its own data, so the config must declare the model's "
            "classes (num_classes or classes)"
        )
    if first is None and options.input_shape is None:
        raise TaskError(f"{KEY}.input_shape: a node that reads no data needs the model's input_shape (or a test_path)")
    features = options.features or FEATURE_DEFAULTS.get(fmt or "")

    def read(path: str, key: str, group: str | None) -> Samples:
        assert fmt is not None and label is not None  # a file to read has both (above)
        return select(read_columns(path, fmt, key, split=options.split), path, label, features, group)

    train = [read(p, f"{KEY}.path", by) for p in paths]
    test_set = read(test_path, f"{KEY}.test_path", None) if test_path else None
    every = [*train, *([test_set] if test_set else [])]
    classes = options.classes
    if classifies and classes is None and any(s.labels.dtype.kind == "U" for s in every):
        classes = sorted({name for s in every if s.labels.dtype.kind == "U" for name in s.labels.tolist()})
        logger.info("%s.classes: the label names read, sorted: %s", KEY, classes)
    if classifies:
        ids = [class_ids(s, classes) for s in every]
        num_classes = options.num_classes or (len(classes) if classes else 1 + max(int(y.max(initial=0)) for y in ids))
    else:
        ids = [targets(s, kind) for s in every]
        num_classes = len(label) if isinstance(label, list) else int(ids[0].shape[1]) if ids and ids[0].ndim == 2 else 1
    shape = tuple(options.input_shape) if options.input_shape else tuple(int(d) for d in every[0].x.shape[1:])
    schema = DataSchema(shape, num_classes, label_kind=LABEL_KINDS[kind])
    for samples, y in zip(every, ids):
        check_data(samples.path, samples.x, y, schema)
    x_train = np.concatenate([s.x for s in train]) if train else np.empty((0, *shape), dtype=np.float32)
    no_labels = np.empty((0,) if num_classes == 1 or classifies else (0, num_classes), np.int64 if classifies else np.float32)
    y_train = np.concatenate(ids[: len(train)]) if train else no_labels
    offsets = np.cumsum([0, *(len(s.x) for s in train)])
    parts = [np.arange(a, b, dtype=np.int64) for a, b in zip(offsets[:-1], offsets[1:])] if len(train) > 1 else None
    if test_set is None:
        x_test, y_test = np.empty((0, *shape), dtype=np.float32), no_labels
    else:
        x_test, y_test = test_set.x, ids[-1]
    dataset = Dataset(
        name="files",
        x_train=torch.from_numpy(x_train),
        y_train=torch.from_numpy(y_train),
        x_test=torch.from_numpy(x_test),
        y_test=torch.from_numpy(y_test),
        num_classes=num_classes,
        input_shape=shape,
        kind=kind,
    )
    logger.info(
        "dataset files (%s): %d train rows from %d file(s), %d test rows, %d classes, input %s",
        fmt, len(y_train), len(train), len(y_test), num_classes, shape,
    )
    return FileData(dataset, schema, parts, train[0].groups if natural and train else None)


class SiteData:
    """The data of one deployed client, which reads only its own: its (train, local test) split;
    a :class:`fedweave.federated.client.ClientSplits` that answers for its own id alone."""

    def __init__(self, client_id: int, num_clients: int, data: Dataset, train: np.ndarray, test: np.ndarray):
        self.client_id = client_id
        self.num_clients = num_clients
        self._x_train, self._y_train = data.x_train[train], data.y_train[train]
        self._x_test, self._y_test = data.x_train[test], data.y_train[test]

    def __len__(self) -> int:
        return self.num_clients

    def train_size(self, client_id: int) -> int:
        self._own(client_id)
        return len(self._y_train)

    def split(self, client_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x_train, y_train, x_test, y_test`` of this site's client."""
        self._own(client_id)
        return self._x_train, self._y_train, self._x_test, self._y_test

    def _own(self, client_id: int) -> None:
        if client_id != self.client_id:
            raise ValueError(f"this site holds the data of client {self.client_id} only, not of client {client_id}")
