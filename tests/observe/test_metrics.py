"""Tests of fedweave.observe.metrics: one JSON line per round, truncation for resume."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from fedweave.errors import CheckpointError
from fedweave.observe.metrics import MetricsWriter, read_metrics


def test_one_line_per_record_appended(tmp_path: Path) -> None:
    writer = MetricsWriter(tmp_path / "metrics.jsonl")
    writer.append({"round": 1, "train_loss": 0.5, "test_accuracy": None})
    writer.append({"round": 2, "train_loss": 0.25, "test_accuracy": 0.75})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"round": 1, "train_loss": 0.5, "test_accuracy": None},
        {"round": 2, "train_loss": 0.25, "test_accuracy": 0.75},
    ]
    assert read_metrics(writer.path) == [json.loads(line) for line in lines]


def test_non_finite_numbers_are_written_as_null(tmp_path: Path) -> None:
    writer = MetricsWriter(tmp_path / "metrics.jsonl")
    writer.append({"round": 1, "train_loss": float("nan"), "test_loss": float("inf"), "bytes_sent": 8})
    text = writer.path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert read_metrics(writer.path) == [{"round": 1, "train_loss": None, "test_loss": None, "bytes_sent": 8}]


def test_floats_round_trip_exactly(tmp_path: Path) -> None:
    writer = MetricsWriter(tmp_path / "metrics.jsonl")
    value = 0.1 + 0.2
    writer.append({"round": 1, "train_loss": value})
    assert read_metrics(writer.path)[0]["train_loss"] == value


def test_truncate_after_keeps_earlier_rounds(tmp_path: Path) -> None:
    writer = MetricsWriter(tmp_path / "metrics.jsonl")
    for rnd in range(1, 6):
        writer.append({"round": rnd})
    writer.truncate_after(3)
    assert read_metrics(writer.path) == [{"round": 1}, {"round": 2}, {"round": 3}]
    writer.truncate_after(0)
    assert read_metrics(writer.path) == []
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]


def test_a_missing_file_has_no_records(tmp_path: Path) -> None:
    assert read_metrics(tmp_path / "none.jsonl") == []
    MetricsWriter(tmp_path / "none.jsonl").truncate_after(2)
    assert read_metrics(tmp_path / "none.jsonl") == []


def test_a_torn_last_line_is_dropped_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    writer = MetricsWriter(tmp_path / "metrics.jsonl")
    writer.append({"round": 1, "train_loss": 0.5})
    writer.append({"round": 2, "train_loss": 0.25})
    whole = writer.path.read_bytes()
    writer.path.write_bytes(whole[: len(whole) - 9])  # killed while writing round 2's line
    with caplog.at_level(logging.WARNING, logger="fedweave.observe.metrics"):
        assert read_metrics(writer.path) == [{"round": 1, "train_loss": 0.5}]
    assert "dropped its torn last line 2" in caplog.text
    writer.truncate_after(1)  # what a resume does: the file is whole again
    assert writer.path.read_text() == '{"round": 1, "train_loss": 0.5}\n'


def test_garbage_after_a_crash_is_dropped_too(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"round": 1}\n\x00\x00\xff\xfe\n')
    assert read_metrics(path) == [{"round": 1}]


@pytest.mark.parametrize("bad", [b"{\"round\": 2", b"[1, 2]", b"\xff\xfe"])
def test_a_bad_line_before_the_last_is_an_error_naming_it(tmp_path: Path, bad: bytes) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"round": 1}\n' + bad + b'\n{"round": 3}\n')
    with pytest.raises(CheckpointError, match=r"^metrics file '.*metrics\.jsonl' line 2: not a JSON record; the file is corrupted$"):
        read_metrics(path)


def test_each_record_is_one_write_synced_to_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[bytes] = []
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append((tmp_path / "metrics.jsonl").read_bytes()))
    writer = MetricsWriter(tmp_path / "metrics.jsonl")
    writer.append({"round": 1})
    writer.append({"round": 2})
    assert synced == [b'{"round": 1}\n', b'{"round": 1}\n{"round": 2}\n']


def test_a_record_not_synced_is_written_whole_and_synced_with_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[bytes] = []
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append((tmp_path / "metrics.jsonl").read_bytes()))
    writer = MetricsWriter(tmp_path / "metrics.jsonl")
    writer.append({"round": 1}, sync=False)
    assert synced == [] and read_metrics(tmp_path / "metrics.jsonl") == [{"round": 1}]
    writer.append({"round": 2})
    assert synced == [b'{"round": 1}\n{"round": 2}\n']
