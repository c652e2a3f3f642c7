"""Tests of fedweave.observe.status: progress and an ETA from a run's files, computed by hand."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedweave import cli
from conftest import SMALL, poll
from fedweave.observe.rundata import load_run, read_records
from fedweave.observe.status import eta, status_rows, time_so_far

from .conftest import fed_record, write_run


def test_a_federated_run_going_on(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "fed", {"name": "fed", "rounds": 10},
                        [fed_record(1, None, 2.0), fed_record(2, 0.5, 2.0), fed_record(3, None, 2.0),
                         fed_record(4, 0.75, 2.0)], tail='{"round": 5')
    metrics = run_dir / "metrics.jsonl"
    os.utime(metrics, (1000.0, 1000.0))
    run = load_run(run_dir)
    assert eta(run) == pytest.approx(12.0)  # 8 s for 4 of 10 rounds: 12 s for the other 6
    # time so far: 8 s to the last record, written 90 s ago
    assert status_rows(run, now=1090.0) == [
        ("run", "fed"), ("mode", "federated"), ("progress", "4/10 rounds (40 %)"),
        ("test accuracy", "0.7500 (round 4)"), ("best test accuracy", "0.7500 (round 4)"),
        ("time so far", "1m38s since the run began"), ("ETA", "12.0 s at the pace so far"), ("last record", "1m30s ago"),
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


def test_time_so_far_counts_from_the_runs_start(tmp_path: Path) -> None:
    begun = write_run(tmp_path / "begun", {"name": "b", "rounds": 3}, [])
    (begun / "metrics.jsonl").unlink()
    os.utime(begun / "config.yaml", (500.0, 500.0))
    assert time_so_far(load_run(begun), now=512.5) == 12.5  # no record yet: since the config was written
    # a record's elapsed (start-up included) wins over the sum of the rounds' wall_time
    later = write_run(tmp_path / "later", {"name": "l", "rounds": 3},
                      [fed_record(1, 0.5, 1.0, elapsed=4.0), fed_record(2, 0.6, 1.0, elapsed=5.0)])
    os.utime(later / "metrics.jsonl", (700.0, 700.0))
    assert time_so_far(load_run(later), now=703.0) == 8.0
    done = write_run(tmp_path / "done", {"name": "d", "rounds": 2},
                     [fed_record(1, 0.5, 1.0, elapsed=4.0), fed_record(2, 0.6, 1.0, elapsed=5.0)])
    assert time_so_far(load_run(done), now=1e9) == 5.0  # finished: its last record's


def test_status_of_a_running_run_that_sleeps(tmp_path: Path) -> None:
    """Clients emulated 200x slower than they are: rounds of a second or more. The time so far the
    status reports lies between the time since the config was written and since the run was launched."""
    run_dir = tmp_path / "slow"
    launched = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "fedweave", "run", *SMALL, "rounds=6", "clients=2",
                             "heterogeneity.slowdown=200", "--run-dir", str(run_dir), "-q"])
    try:
        assert poll(lambda: len(read_records(run_dir / "metrics.jsonl")[0]) >= 1, timeout=120)
        run = load_run(run_dir)
        now = time.time()
        so_far = time_so_far(run, now)
        assert so_far is not None and proc.poll() is None  # still running
        assert now - (run_dir / "config.yaml").stat().st_mtime - 0.1 <= so_far <= now - launched + 0.1
        assert so_far > run.records[-1]["wall_time"]  # not the round's time alone
    finally:
        proc.kill()
        proc.wait()
