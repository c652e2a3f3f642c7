"""Columns to samples: the feature columns stacked into float32 samples, the label column into class ids
or, for regression and multilabel tasks, float targets (one column, or several stacked)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fedweave.errors import TaskError

Columns = dict[str, np.ndarray]
"""A file's columns: name -> array whose first axis is the row."""


@dataclass(frozen=True, eq=False)
class Samples:
    """One file's rows: ``x`` float32 ``(N, *shape)``, raw labels (numbers or names), the partition column."""

    path: str
    x: np.ndarray
    labels: np.ndarray
    groups: np.ndarray | None


def column_array(values: Sequence[object], path: str, name: str) -> np.ndarray:
    """``values`` as one array: numbers as float64 (nested lists keep their shape), else strings."""
    try:
        return np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        pass
    array = np.asarray(values, dtype=object)
    if array.ndim != 1 or not all(isinstance(v, str) for v in array):
        raise TaskError(f"{path}: column '{name}' holds neither numbers of one shape nor strings")
    return array.astype(str)


def select(columns: Columns, path: str, label: str | list[str], features: list[str] | None, by: str | None) -> Samples:
    """The samples of ``columns``: ``features`` (default every column but the label's and ``by``), one column
    keeping its shape, several flattened and concatenated in order; labels and the partition column raw
    (a list of label columns: stacked into one (N, k) array, each column a number per row)."""
    names = [label] if isinstance(label, str) else list(label)
    wanted = [("task.dataset_options.label", name) for name in names] + [("task.partition.by", by)]
    wanted += [("task.dataset_options.features", name) for name in features or []]
    for option, name in wanted:
        if name is not None and name not in columns:
            raise TaskError(f"{option}: {path} has no column '{name}'; it has {', '.join(sorted(columns))}")
    chosen = features if features is not None else [n for n in columns if n not in (*names, by)]
    if not chosen:
        raise TaskError(f"task.dataset_options.features: {path} has no column besides the label")
    rows = {len(a) for a in columns.values()}
    if len(rows) > 1:
        raise TaskError(f"{path}: columns of unequal lengths {sorted(rows)}")
    for name in chosen:
        if columns[name].dtype.kind not in "biuf":
            raise TaskError(f"task.dataset_options.features: column '{name}' of {path} is not numeric")
    if len(chosen) == 1:
        x = columns[chosen[0]]
    else:
        x = np.concatenate([columns[n].reshape(len(columns[n]), -1) for n in chosen], axis=1)
    if isinstance(label, str):
        labels = columns[label]
    else:
        for name in names:
            if columns[name].dtype.kind not in "biuf" or columns[name].ndim != 1:
                raise TaskError(f"task.dataset_options.label: column '{name}' of {path} is not one number per row")
        labels = np.stack([columns[n] for n in names], axis=1).astype(np.float64)
    return Samples(path, np.ascontiguousarray(x, dtype=np.float32), labels, None if by is None else columns[by])


def class_ids(samples: Samples, classes: list[str] | None) -> np.ndarray:
    """The labels of ``samples`` as int64 class ids: names by their place in ``classes``, numbers
    as they are (whole and non-negative; a fractional label is refused, never rounded)."""
    y, path = samples.labels, samples.path
    if y.ndim != 1:
        raise TaskError(f"task.dataset_options.label: {path} has labels of shape {y.shape[1:]}, expected one per row")
    if y.dtype.kind == "U":
        if classes is None:
            raise TaskError(f"task.dataset_options.classes: {path} has label names; list them in class-id order")
        index = {name: i for i, name in enumerate(classes)}
        unknown = sorted(set(y.tolist()) - set(index))
        if unknown:
            raise TaskError(f"{path}: label '{unknown[0]}' is not among task.dataset_options.classes {classes}")
        return np.asarray([index[v] for v in y.tolist()], dtype=np.int64)
    whole = np.isfinite(y) & (y == np.round(y)) & (y >= 0)
    if not whole.all():
        raise TaskError(f"{path}: label {y[~whole][0].item()!r} is not a class id (a whole number >= 0)")
    return y.astype(np.int64)


def targets(samples: Samples, kind: str) -> np.ndarray:
    """The labels of ``samples`` as float32 targets of a regression (any finite number) or a multilabel
    task (0 or 1, one column per label)."""
    y, path = samples.labels, samples.path
    if y.dtype.kind not in "biuf":
        raise TaskError(f"task.dataset_options.label: {path} has labels that are not numbers; a {kind} task needs numbers")
    if y.ndim > 2 or (kind == "multilabel" and y.ndim != 2):
        raise TaskError(
            f"task.dataset_options.label: {path} has labels of shape {y.shape[1:]}; a {kind} task needs "
            + ("one 0/1 column per label (a list of columns, or one column of lists)" if kind == "multilabel"
               else "one number per row, or a list of columns")
        )
    if not np.isfinite(y).all():
        raise TaskError(f"{path}: a label is not a finite number")
    if kind == "multilabel" and not np.isin(y, (0, 1)).all():
        raise TaskError(f"{path}: label {y[~np.isin(y, (0, 1))][0].item()!r} of a multilabel task is not 0 or 1")
    return y.astype(np.float32)
