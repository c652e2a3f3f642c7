"""Tests of fedweave.task.assignment: the JSON map of from_file, read and checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedweave.errors import ConfigError
from fedweave.task.assignment import read_assignment


def write(tmp_path: Path, data: object) -> str:
    path = tmp_path / "map.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_the_map_gives_each_client_its_rows(tmp_path: Path) -> None:
    parts = read_assignment(write(tmp_path, {"1": [4, 0], "0": [1, 2, 3]}), 6, 2, allow_overlap=False, min_samples=1)
    assert [p.tolist() for p in parts] == [[1, 2, 3], [4, 0]]  # row 5 unused
    listed = read_assignment(write(tmp_path, [[0, 1], [1, 2]]), 3, 2, allow_overlap=True, min_samples=2)
    assert [p.tolist() for p in listed] == [[0, 1], [1, 2]]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"0": [0], "2": [1]}, "names clients .*expected exactly 0..1"),
        ({"0": [0, 1.0], "1": [2]}, "client 0's rows must be a list of integers"),
        ({"0": [0, True], "1": [2]}, "client 0's rows must be a list of integers"),
        ({"0": [0, 9], "1": [2]}, "client 0 names row 9, outside 0..3"),
        ({"0": [0, -1], "1": [2]}, "client 0 names row -1, outside 0..3"),
        ({"0": [0, 0], "1": [2]}, "client 0 names a row twice"),
        ({"0": [0, 1], "1": [1, 2]}, "row 1 belongs to two clients; set task.partition.allow_overlap"),
        ({"0": [0, 1], "1": []}, "client 1 has 0 rows < task.partition.min_samples 1"),
    ],
)
def test_a_bad_map_is_one_line_naming_the_file(tmp_path: Path, data: object, message: str) -> None:
    path = write(tmp_path, data)
    with pytest.raises(ConfigError, match=f"^task.partition.file: {path}.*{message}"):
        read_assignment(path, 4, 2, allow_overlap=False, min_samples=1)


def test_a_missing_or_broken_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="^task.partition.file: no such file: "):
        read_assignment(str(tmp_path / "none.json"), 4, 2, allow_overlap=False, min_samples=1)
    (tmp_path / "map.json").write_text("{")
    with pytest.raises(ConfigError, match="is not JSON"):
        read_assignment(str(tmp_path / "map.json"), 4, 2, allow_overlap=False, min_samples=1)
