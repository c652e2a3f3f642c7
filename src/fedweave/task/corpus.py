"""``task.dataset: files`` of a ``task.kind: language_model``: each site's text as token blocks.

A training file is plain text (``format: text``: a file, or a folder's files matching ``pattern``)
or JSON Lines whose ``text`` field holds each record's text. Each path's texts are tokenised
(:mod:`fedweave.task.tokenize`) and cut into blocks of ``task.sequence_length`` tokens: the
samples, which are also the targets (the loss shifts them: next-token cross-entropy). A ``{client}``
path gives each client its own files; one path is partitioned by block. ``test_path`` is the
central held-out text.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from fedweave.errors import TaskError
from fedweave.task.datasets import Dataset
from fedweave.task.schema import DataSchema, check_data
from fedweave.task.sources import FileOptions, infer_format, read_columns
from fedweave.task.tokenize import Blocks, Tokenizer, blocks, load_tokenizer

logger = logging.getLogger(__name__)

KEY = "task.dataset_options"


def text_format(options: FileOptions, first: str | None, key: str) -> str:
    """The format the text is read in: text, or jsonl with its ``text`` field; another is refused."""
    fmt = options.format or (infer_format(first, key) if first else "text")
    if fmt == "jsonl" and options.text is None:
        raise TaskError(f"{KEY}.text: a language model reads jsonl's text from a field; name it")
    if fmt not in ("text", "jsonl"):
        raise TaskError(f"{KEY}.format: a language model reads text (format text, or jsonl with its text field), got {fmt}")
    return fmt


def load_text(options: FileOptions, paths: list[str], settings: Blocks, *, test: bool = True) -> tuple[Dataset, DataSchema, list[np.ndarray] | None]:
    """The token blocks of the training files ``paths`` (each client's, or one to partition) and, with
    ``test``, of ``test_path``: the dataset, its schema and each path's rows (with several paths)."""
    test_path = options.test_path if test else None
    first = paths[0] if paths else test_path
    fmt = text_format(options, first, f"{KEY}.path" if paths else f"{KEY}.test_path")
    tokenizer = load_tokenizer(settings.tokenizer)
    length = settings.sequence_length
    schema = DataSchema((length,), tokenizer.vocab_size, dtype="int64", label_kind="tokens")

    def read(path: str, key: str) -> np.ndarray:
        rows = _blocks(path, fmt, key, options, tokenizer, length)
        check_data(path, rows, rows, schema)
        return rows

    train = [read(p, f"{KEY}.path") for p in paths]
    empty = np.empty((0, length), dtype=np.int64)
    x_train = np.concatenate(train) if train else empty
    x_test = read(test_path, f"{KEY}.test_path") if test_path else empty
    offsets = np.cumsum([0, *(len(rows) for rows in train)])
    parts = [np.arange(a, b, dtype=np.int64) for a, b in zip(offsets[:-1], offsets[1:])] if len(train) > 1 else None
    x_train_t, x_test_t = torch.from_numpy(x_train), torch.from_numpy(x_test)
    dataset = Dataset(
        name="files", x_train=x_train_t, y_train=x_train_t, x_test=x_test_t, y_test=x_test_t,
        num_classes=tokenizer.vocab_size, input_shape=(length,), kind="language_model",
    )
    logger.info(
        "dataset files (%s): %d training blocks of %d tokens from %d path(s), %d test blocks, a vocabulary of %d",
        fmt, len(x_train), length, len(train), len(x_test), tokenizer.vocab_size,
    )
    return dataset, schema, parts


def _blocks(path: str, fmt: str, key: str, options: FileOptions, tokenizer: Tokenizer, length: int) -> np.ndarray:
    """The blocks of one path's texts, in order."""
    columns = read_columns(path, fmt, key, pattern=options.pattern)
    field = "text" if fmt == "text" else options.text
    if field not in columns:
        raise TaskError(f"{KEY}.text: {path} has no field '{field}'; it has {', '.join(sorted(columns))}")
    texts = columns[field]
    if not all(isinstance(t, str) for t in texts.tolist()):
        raise TaskError(f"{KEY}.text: field '{field}' of {path} does not hold text in every record")
    rows = blocks(texts.tolist(), tokenizer, length)
    if not len(rows):
        raise TaskError(f"{path}: fewer tokens than one block of task.sequence_length {length}")
    return rows
