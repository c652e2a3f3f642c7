"""Text to token blocks: bytes, the cut into blocks, and a tokenizer read from a local folder."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedweave.errors import TaskError
from fedweave.task.tokenize import ByteTokenizer, blocks, load_tokenizer


def test_bytes_are_the_utf8_bytes() -> None:
    assert ByteTokenizer().encode("aé") == [97, 0xC3, 0xA9]
    assert load_tokenizer(None).vocab_size == 256


def test_blocks_concatenate_the_texts_and_drop_the_incomplete_last_block() -> None:
    rows = blocks(["abc", "defg"], ByteTokenizer(), 3)
    np.testing.assert_array_equal(rows, [[97, 98, 99], [100, 101, 102]])  # "g" is left over
    assert rows.dtype == np.int64
    assert blocks(["ab"], ByteTokenizer(), 3).shape == (0, 3)


def test_a_tokenizer_from_a_local_folder(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {"[UNK]": 0, "def": 1, "return": 2, "x": 3}
    model = tokenizers.models.WordLevel(vocab, unk_token="[UNK]")
    raw = tokenizers.Tokenizer(model)
    raw.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]").save_pretrained(str(tmp_path))
    tokenizer = load_tokenizer(str(tmp_path))
    assert tokenizer.vocab_size == 4
    assert tokenizer.encode("def x return y") == [1, 3, 2, 0]


def test_a_missing_tokenizer_folder_is_one_line(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    with pytest.raises(TaskError, match="^task.tokenizer: no such folder"):
        load_tokenizer(str(tmp_path / "absent"))
