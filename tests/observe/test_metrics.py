"""Tests of fedweave.observe.metrics: one JSON line per round, truncation for resume."""

from __future__ import annotations

import json
from pathlib import Path

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
