"""Tests of fedweave.observe.status: progress and an ETA from a run's files, computed by hand."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fedweave import cli
from fedweave.observe.rundata import load_run
from fedweave.observe.status import eta, status_rows

from .conftest import fed_record, write_run


def test_a_federated_run_going_on(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "fed", {"name": "fed", "rounds": 10},
                        [fed_record(1, None, 2.0), fed_record(2, 0.5, 2.0), fed_record(3, None, 2.0),
                         fed_record(4, 0.75, 2.0)], tail='{"round": 5')
    metrics = run_dir / "metrics.jsonl"
    os.utime(metrics, (1000.0, 1000.0))
    run = load_run(run_dir)
    assert eta(run) == pytest.approx(12.0)  # 8 s for 4 of 10 rounds: 12 s for the other 6
    assert status_rows(run, now=1090.0) == [
        ("run", "fed"), ("mode", "federated"), ("progress", "4/10 rounds (40 %)"),
        ("test accuracy", "0.7500 (round 4)"), ("best test accuracy", "0.7500 (round 4)"),
        ("time so far", "8.0 s"), ("ETA", "12.0 s at the pace so far"), ("last record", "1m30s ago"),
        ("note", "metrics.jsonl line 5 is incomplete (being written); left out"),
    ]


def test_a_data_parallel_run_by_epochs_and_a_finished_one(tmp_path: Path) -> None:
    config = {"name": "dp", "mode": "data_parallel", "data_parallel": {"epochs": 4}}
    recs = [{"step": 10, "epoch": 0.5, "wall_time": 15.0, "test_accuracy": 0.6},
            {"step": 20, "epoch": 1.0, "wall_time": 30.0, "test_accuracy": 0.55}]
    run = load_run(write_run(tmp_path / "dp", config, recs))
    assert eta(run) == pytest.approx(90.0)  # a quarter of the epochs in 30 s
    rows = dict(status_rows(run))
    assert (rows["progress"], rows["best test accuracy"], rows["ETA"]) == (
        "step 20 (epoch 1.00 of 4) (25 %)", "0.6000 (step 10)", "1m30s at the pace so far")
    done = load_run(write_run(tmp_path / "done", config, [*recs, {"step": 80, "epoch": 4.0, "wall_time": 120.0}]))
    assert dict(status_rows(done))["state"] == "finished" and "ETA" not in dict(status_rows(done))


def test_cli_status_prints_the_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = write_run(tmp_path / "fed", {"name": "fed", "rounds": 2}, [fed_record(1, 0.5, 1.0)])
    assert cli.main(["status", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "| progress " in out and "1/2 rounds (50 %)" in out and "0.5000 (round 1)" in out
    assert cli.main(["status", str(tmp_path / "nope")]) == 2
    assert "is not a run directory: it has no config.yaml" in capsys.readouterr().err
