"""A language model's text files: plain text (a file, a folder's files by pattern) and jsonl's text
field, tokenised into blocks that are their own targets, per client with {client}."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fedweave.errors import ConfigError, TaskError
from fedweave.schema import parse
from fedweave.task.files import load_files
from fedweave.task.sources.options import FileOptions
from fedweave.task.tokenize import Blocks


def options(**values: object) -> FileOptions:
    return parse(FileOptions, values, "task.dataset_options")


def test_each_clients_folder_of_text_files_becomes_its_blocks(tmp_path: Path) -> None:
    for client, files in enumerate([{"a.py": "abcd", "sub/b.py": "efgh", "c.txt": "skipped"}, {"x.py": "ijklmn"}]):
        for name, text in files.items():
            (tmp_path / str(client) / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / str(client) / name).write_text(text)
    (tmp_path / "test.txt").write_text("opqr")
    opts = options(path=f"{tmp_path}/{{client}}", format="text", pattern="*.py", test_path=str(tmp_path / "test.txt"))
    files = load_files(opts, [opts.path_of(0), opts.path_of(1)], kind="language_model", text=Blocks(None, 2))
    data = files.dataset
    assert data.x_train.tolist() == [[97, 98], [99, 100], [101, 102], [103, 104], [105, 106], [107, 108], [109, 110]]
    assert data.y_train is data.x_train and data.x_test.tolist() == [[111, 112], [113, 114]]
    assert [p.tolist() for p in files.parts] == [[0, 1, 2, 3], [4, 5, 6]]
    assert (data.num_classes, data.input_shape, data.kind) == (256, (2,), "language_model")
    assert files.schema.to_dict() == {"input_shape": [2], "num_classes": 256, "dtype": "int64", "label_kind": "tokens"}


def test_jsonl_reads_its_text_field(tmp_path: Path) -> None:
    path = tmp_path / "site.jsonl"
    path.write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(["abc", "def"])))
    files = load_files(options(path=str(path), text="text"), [str(path)], test=False, kind="language_model",
                       text=Blocks(None, 3))
    np.testing.assert_array_equal(files.dataset.x_train.numpy(), [[97, 98, 99], [100, 101, 102]])


def test_text_too_short_for_one_block_and_a_missing_field_are_one_line(tmp_path: Path) -> None:
    path = tmp_path / "short.txt"
    path.write_text("ab")
    with pytest.raises(TaskError, match="fewer tokens than one block of task.sequence_length 3"):
        load_files(options(path=str(path)), [str(path)], test=False, kind="language_model", text=Blocks(None, 3))
    records = tmp_path / "r.jsonl"
    records.write_text('{"body": "abc"}\n')
    with pytest.raises(TaskError, match="^task.dataset_options.text: .* has no field 'text'"):
        load_files(options(path=str(records), text="text"), [str(records)], test=False, kind="language_model",
                   text=Blocks(None, 3))


def test_a_folder_without_matching_files_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(TaskError, match=r"^task.dataset_options.pattern: .* has no file matching '\*.py'"):
        load_files(options(path=str(tmp_path), format="text", pattern="*.py"), [str(tmp_path)], test=False,
                   kind="language_model", text=Blocks(None, 3))


def test_text_options_are_checked_at_load() -> None:
    with pytest.raises(ConfigError, match="^config key 'task.dataset_options.text': only format jsonl"):
        options(format="csv", text="body")
    assert options(format="text").label is None  # text needs no label column
