"""Text to the fixed-length token blocks a language model trains on.

A tokenizer is ``encode(text) -> ids`` with a ``vocab_size``: :class:`ByteTokenizer` (the UTF-8
bytes, 256 ids; the default) or a ``transformers`` tokenizer read from a local folder
(``task.tokenizer``). :func:`blocks` concatenates the ids of a sequence of texts and cuts them
into rows of ``task.sequence_length`` tokens, the incomplete last one dropped.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from fedweave.errors import TaskError


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...


class ByteTokenizer:
    """Each UTF-8 byte of the text is one token."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


class PretrainedTokenizer:
    """A ``transformers`` tokenizer saved in a local folder (``save_pretrained``); no special tokens added."""

    def __init__(self, folder: str) -> None:
        from fedweave.task.hf import require

        transformers = require("transformers", "task.tokenizer")
        if not os.path.isdir(folder):
            raise TaskError(f"task.tokenizer: no such folder: {folder} (a tokenizer saved by save_pretrained)")
        try:
            self._tokenizer: Any = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise TaskError(f"task.tokenizer: {folder} holds no tokenizer transformers can read: {exc}") from None
        self.vocab_size = len(self._tokenizer)

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])


def load_tokenizer(folder: str | None) -> Tokenizer:
    """The tokenizer of ``task.tokenizer``: a folder's, or bytes when none is given."""
    return ByteTokenizer() if folder is None else PretrainedTokenizer(folder)


@dataclass(frozen=True)
class Blocks:
    """How a language model's text becomes its samples: the tokenizer's folder (none: bytes) and
    the tokens per block."""

    tokenizer: str | None
    sequence_length: int


def blocks(texts: Iterable[str], tokenizer: Tokenizer, length: int) -> np.ndarray:
    """The ids of ``texts``, one after the other, cut into int64 rows of ``length`` ((N, length); the
    tokens after the last whole row are dropped)."""
    ids = np.fromiter((i for text in texts for i in tokenizer.encode(text)), dtype=np.int64)
    rows = len(ids) // length
    return ids[: rows * length].reshape(rows, length)
