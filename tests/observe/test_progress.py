"""Tests of fedweave.observe.progress: the progress line and the summary table."""

from __future__ import annotations

import io
import threading
from pathlib import Path
from typing import Any

import pytest

from conftest import free_port, small_config
from fedweave import cli
from fedweave.nodes.client import run_client
from fedweave import config as config_mod
from fedweave.observe import progress
from fedweave.observe.progress import ProgressBar, run_summary, summary_table


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def record(rnd: int, accuracy: float | None = 0.5, **extra: Any) -> dict[str, Any]:
    return {
        "round": rnd,
        "train_loss": 0.25,
        "test_accuracy": accuracy,
        "test_loss": 0.75,
        "clients_sampled": 4,
        "clients_completed": 3,
        "bytes_sent": 2_000_000,
        "bytes_received": 1_500_000,
        **extra,
    }


@pytest.fixture
def frozen_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress.time, "perf_counter", lambda: 12.0)


@pytest.mark.usefixtures("frozen_clock")
def test_a_line_per_round_when_not_a_terminal() -> None:
    stream = io.StringIO()
    bar = ProgressBar(10, stream, width=10)
    bar.update(record(1))
    bar.update(record(10, accuracy=None))
    assert stream.getvalue().splitlines() == [
        "round  1/10 [#.........] loss 0.2500 acc 0.5000 clients 3/4 0.0s ETA 0.0s",
        "round 10/10 [##########] loss 0.2500 acc - clients 3/4 0.0s",
    ]


@pytest.mark.usefixtures("frozen_clock")
def test_a_terminal_redraws_one_line_and_ends_it_on_the_last_round() -> None:
    stream = Terminal()
    bar = ProgressBar(2, stream, start_round=1, width=4)
    bar.update(record(2))
    assert stream.getvalue() == "\rround 2/2 [####] loss 0.2500 acc 0.5000 clients 3/4 0.0s\n"
    partial = Terminal()
    ProgressBar(4, partial, width=4).update(record(1))
    assert partial.getvalue() == "\rround 1/4 [#...] loss 0.2500 acc 0.5000 clients 3/4 0.0s ETA 0.0s"


def test_the_eta_follows_the_pace_of_the_rounds_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([100.0, 112.0, 118.0])
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    stream = io.StringIO()
    bar = ProgressBar(10, stream, width=10)  # a resumed server's bar does not know it starts after round 4
    bar.update(record(5))  # 1 round in 12 s: 5 left take 60 s
    bar.update(record(6))  # 2 rounds in 18 s: 4 left take 36 s
    assert [line.rsplit(" ", 3)[1:] for line in stream.getvalue().splitlines()] == [
        ["12.0s", "ETA", "60.0s"], ["18.0s", "ETA", "36.0s"]]


def test_summary_table_layout() -> None:
    assert summary_table([("a", "1"), ("long label", "22")]) == (
        "+------------+----+\n"
        "| a          |  1 |\n"
        "| long label | 22 |\n"
        "+------------+----+"
    )


def test_run_summary_rows() -> None:
    records = [record(1, 0.5), record(2, 0.9), record(3, 0.8, federated_accuracy=0.7)]
    rows = dict(run_summary(records, "runs/x", 3.21))
    assert rows == {
        "rounds": "3",
        "final test accuracy": "0.8000",
        "best test accuracy": "0.9000",
        "final test loss": "0.7500",
        "federated accuracy (local splits)": "0.7000",
        "data sent / received": "6.0 MB / 4.5 MB",
        "wall time": "3.2 s",
        "run directory": "runs/x",
    }


def test_run_summary_without_evaluations() -> None:
    rows = dict(run_summary([record(1, None, test_loss=None)], "d", 0.0))
    assert rows["final test accuracy"] == rows["best test accuracy"] == rows["final test loss"] == "-"
    assert "federated accuracy (local splits)" not in rows


@pytest.mark.parametrize("quiet", [False, True])
def test_the_server_of_a_deployment_shows_the_progress_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], quiet: bool
) -> None:
    port = free_port()
    config = small_config("rounds=2", "clients=1", "transport=grpc", f"grpc.address=127.0.0.1:{port}")
    path = tmp_path / "config.yaml"
    path.write_text(config_mod.to_yaml(config))
    client = threading.Thread(target=run_client, args=(config, 0), daemon=True)
    client.start()
    assert cli.main(["server", str(path), "--run-dir", str(tmp_path / "run"), *(["-q"] if quiet else [])]) == 0
    client.join(20)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("round ")]
    if quiet:
        assert lines == []
        return
    assert [line.split(" loss ")[0] for line in lines] == ["round 1/2 [############............]",
                                                            "round 2/2 [########################]"]
    assert " ETA " in lines[0] and " ETA " not in lines[1]


def test_share_done_and_eta_text_of_a_data_parallel_line() -> None:
    assert progress.share_done({"step": 30, "epoch": 1.5}, None, 3) == 0.5  # by epochs
    assert progress.share_done({"step": 30, "epoch": 1.5}, 40, 3) == 0.75  # by steps
    assert progress.eta_text(6.0, 0.75) == " ETA 2.0s"
    assert progress.eta_text(6.0, 1.0) == progress.eta_text(0.0, 0.0) == ""
