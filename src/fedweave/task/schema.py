"""What a site's data must look like to train the federation's model, and the check of a file against it.

A :class:`DataSchema` holds no data and no label counts: the shape and dtype of one sample, the
kind of label (class ids, float targets, 0/1 labels) and the model's outputs (classes, targets, labels). A client checks its data against the federation's schema
when it starts (:func:`check_data`) and may declare its own schema, which the federation compares
with :meth:`DataSchema.difference`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from fedweave.errors import TaskError

LabelKind = Literal["class", "target", "labels", "tokens"]

LABEL_KINDS: dict[str, LabelKind] = {
    "classification": "class", "regression": "target", "multilabel": "labels", "language_model": "tokens",
}
"""The label kind of each task kind that reads files."""


@dataclass(frozen=True)
class DataSchema:
    """The shape and dtype of one sample, the label kind and the number of classes (of a ``target``
    or ``labels`` kind: the targets or labels, the model's outputs; of ``tokens``, a language model's
    int64 token blocks that are their own targets: the vocabulary)."""

    input_shape: tuple[int, ...]
    num_classes: int
    dtype: str = "float32"
    label_kind: LabelKind = "class"

    def difference(self, other: DataSchema) -> str | None:
        """Why ``other`` (a site's schema) differs from this one (the federation's), or None."""
        if other.input_shape != self.input_shape:
            return f"{_shape(other.input_shape)}, the federation expects {_shape(self.input_shape)}"
        for name in ("dtype", "label_kind", "num_classes"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return f"{name} {theirs}, the federation expects {mine}"
        return None

    def refusal(self, declared: Any) -> str | None:
        """Why a site that declared ``declared`` (the data schema of its registration, untrusted)
        may not join a federation of this schema, or None."""
        if declared is None:
            return "it declares no data schema, and this federation's sites read their own data"
        try:
            theirs = DataSchema.from_dict(declared)
        except ValueError as exc:
            return f"its data schema is malformed: {exc}"
        why = self.difference(theirs)
        return None if why is None else f"its data has {why}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (a declaration on the wire)."""
        return {"input_shape": list(self.input_shape), "num_classes": self.num_classes,
                "dtype": self.dtype, "label_kind": self.label_kind}

    @classmethod
    def from_dict(cls, data: Any) -> DataSchema:
        """A schema a peer declared, checked field by field; a malformed one is a ValueError."""
        if not isinstance(data, dict) or set(data) != {"input_shape", "num_classes", "dtype", "label_kind"}:
            raise ValueError(f"a data schema has input_shape, num_classes, dtype and label_kind, got {data!r}")
        shape, classes = data["input_shape"], data["num_classes"]
        if not isinstance(shape, list) or not shape or not all(_positive(d) for d in shape) or not _positive(classes):
            raise ValueError(f"a data schema's input_shape and num_classes are positive integers, got {data!r}")
        kind = data["label_kind"]
        if kind not in LABEL_KINDS.values() or data["dtype"] != ("int64" if kind == "tokens" else "float32"):
            raise ValueError(
                f"a data schema has dtype float32 and label_kind class, target or labels, or dtype int64 and "
                f"label_kind tokens, got {data!r}"
            )
        return cls(tuple(shape), classes, dtype=data["dtype"], label_kind=kind)


def check_data(path: str, x: np.ndarray, y: np.ndarray, expected: DataSchema) -> None:
    """Refuse ``path``'s samples ``x`` and labels ``y`` (class ids, or targets and 0/1 labels of shape
    (N,) or (N, outputs)) unless they fit ``expected``: one line naming the file and the difference."""
    shape = tuple(int(d) for d in x.shape[1:])
    if shape != expected.input_shape:
        raise TaskError(f"{path}: {_shape(shape)}, the federation expects {_shape(expected.input_shape)}")
    if str(x.dtype) != expected.dtype:
        raise TaskError(f"{path}: samples of dtype {x.dtype}, the federation expects {expected.dtype}")
    if expected.label_kind == "tokens":
        outside = x[(x < 0) | (x >= expected.num_classes)]
        if outside.size:
            raise TaskError(f"{path}: token {int(outside[0])} is outside the vocabulary of {expected.num_classes}")
        return
    if expected.label_kind != "class":
        outputs = 1 if y.ndim == 1 else int(y.shape[1])
        if outputs != expected.num_classes:
            raise TaskError(f"{path}: {outputs} label column(s), the federation expects {expected.num_classes}")
        return
    outside = y[(y < 0) | (y >= expected.num_classes)]
    if outside.size:
        raise TaskError(
            f"{path}: label {int(outside[0])} is outside the model's {expected.num_classes} classes "
            f"(0..{expected.num_classes - 1})"
        )


def _shape(shape: tuple[int, ...]) -> str:
    """A sample shape as a user reads it: a feature count for flat samples."""
    return f"{shape[0]} features" if len(shape) == 1 else f"samples of shape {shape}"


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
