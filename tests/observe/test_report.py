"""Tests of fedweave.observe.report (and the figures and summary it draws): the series a
report embeds are the values of metrics.jsonl; a comparison's summary is computed by hand."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from fedweave import cli
from fedweave.observe.figures import elapsed, world_changes
from fedweave.observe.report import write_report
from fedweave.observe.rundata import read_records

from .conftest import embedded, fed_record, figure, series, write_run

PNG = b"\x89PNG\r\n\x1a\n"


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_federated_series_equal_the_metrics_file(federated_run: Path) -> None:
    recs = records(federated_run)
    data = embedded(federated_run / "report.html")  # written by `fedweave run --report`
    rounds = [r["round"] for r in recs]
    assert series(data, "accuracy-round", "test accuracy") == (rounds, [r["test_accuracy"] for r in recs])
    assert series(data, "loss-round", "train loss") == (rounds, [r["train_loss"] for r in recs])
    fed = [r for r in recs if r.get("federated_accuracy") is not None]
    assert [r["round"] for r in fed] == [2, 3]  # every 2nd round and the last
    assert series(data, "accuracy-round", "federated accuracy") == ([2, 3], [r["federated_accuracy"] for r in fed])
    assert series(data, "bytes", "up (clients to server)") == (rounds, [r["bytes_received"] for r in recs])
    assert series(data, "bytes", "down (server to clients)") == (rounds, [r["bytes_sent"] for r in recs])
    assert series(data, "clients", "completed") == (rounds, [r["clients_completed"] for r in recs])
    wall = [sum(r["wall_time"] for r in recs[: k + 1]) for k in range(len(recs))]
    assert series(data, "accuracy-time", "test accuracy") == (pytest.approx(wall), [r["test_accuracy"] for r in recs])
    # the timeline: client 1's compute in each round, starting where the round starts
    starts = [sum(r["round_time"] for r in recs[:k]) for k in range(len(recs))]
    computes = [next(c["compute"] for c in r["clients"] if c["id"] == 1) for r in recs]
    assert series(data, "client-timeline", "client 1 compute") == (pytest.approx(starts), computes)
    partition = json.loads((federated_run / "partition.json").read_text())
    assert figure(data, "partition")["matrix"] == partition["histograms"]
    assert "epsilon" not in {f["id"] for f in data["figures"]}  # no DP in this run
    for fig in data["figures"]:
        assert (federated_run / f"report-{fig['id']}.png").read_bytes().startswith(PNG)


def test_data_parallel_series_equal_the_metrics_file(data_parallel_run: Path) -> None:
    recs = records(data_parallel_run)
    data = embedded(data_parallel_run / "report.html")
    steps = [r["step"] for r in recs]
    assert steps == list(range(2, 21, 2))  # 10 steps per epoch, a line every 2
    assert series(data, "loss-step", "train loss") == (steps, [r["train_loss"] for r in recs])
    for worker in (0, 1):
        at = [r["workers"].index(worker) for r in recs]
        assert series(data, "worker-batch", f"worker {worker}") == (steps, [r["batch"][i] for r, i in zip(recs, at)])
        assert series(data, "worker-idle", f"worker {worker}") == (steps, [r["idle_time"][i] for r, i in zip(recs, at)])
    assert series(data, "throughput", "all workers") == (
        steps, pytest.approx([r["samples"] / r["window_time"] for r in recs]))
    assert series(data, "accuracy-time", "test accuracy")[0] == [r["wall_time"] for r in recs if r.get("test_accuracy")]
    assert figure(data, "worker-batch")["marks"] == []  # no world change
    assert data["summary"][0]["progress"] == "step 20 (epoch 2.00 of 2)"


def test_world_changes_are_marked_where_the_workers_change() -> None:
    recs = [
        {"step": 5, "workers": [0, 1, 2]},
        {"step": 10, "workers": [0, 2]},  # 1 died
        {"step": 15, "workers": [0, 2, 3]},  # 3 joined
        {"step": 20, "workers": [0, 2, 3], "lost": [3]},  # the parameter server lost 3
        {"step": 25, "workers": [0, 2]},
    ]
    assert world_changes(recs) == [(10, "worker 1 left"), (15, "worker 3 joined"), (20, "worker 3 left")]


def test_elapsed_sums_federated_rounds_and_stitches_a_resumed_data_parallel_run() -> None:
    assert elapsed([{"wall_time": 1.5}, {"wall_time": 2.0}, {"wall_time": None}], False) == [1.5, 3.5, 3.5]
    assert elapsed([{"wall_time": 1.0}, {"wall_time": 3.0}, {"wall_time": 0.5}], True) == [1.0, 3.0, 3.5]


def test_a_torn_last_line_is_left_out_and_noted(tmp_path: Path) -> None:
    run = write_run(tmp_path / "running", {"name": "r", "rounds": 10},
                    [fed_record(1, 0.5, 1.0), fed_record(2, 0.6, 1.0, epsilon=0.7, rejected={"shape": 1})],
                    tail='{"round": 3, "wall_ti')
    recs, notes = read_records(run / "metrics.jsonl")
    assert [r["round"] for r in recs] == [1, 2]
    assert notes == ["metrics.jsonl line 3 is incomplete (being written); left out"]
    data = embedded(write_report([run]))
    assert series(data, "accuracy-round", "test accuracy") == ([1, 2], [0.5, 0.6])
    assert series(data, "epsilon", "ε") == ([2], [0.7])
    assert series(data, "clients", "rejected") == ([2], [1])
    assert data["summary"][0]["progress"] == "2/10 rounds"
    assert "line 3 is incomplete" in (run / "report.html").read_text()


def test_comparison_overlays_runs_and_summarizes_them(tmp_path: Path) -> None:
    a = write_run(tmp_path / "fedavg", {"name": "a", "rounds": 3},
                  [fed_record(1, 0.5, 2.0), fed_record(2, 0.8, 2.0), fed_record(3, 0.7, 2.0)])
    b = write_run(tmp_path / "scaffold", {"name": "b", "rounds": 3},
                  [fed_record(1, 0.6, 1.0, sent=10, received=5), fed_record(2, 0.65, 1.0, sent=10, received=5),
                   fed_record(3, None, 1.0, sent=10, received=5)])
    c = write_run(tmp_path / "dp", {"name": "c", "mode": "data_parallel", "data_parallel": {"steps": 8}},
                  [{"step": 4, "workers": [0], "batch": [8], "wall_time": 1.0, "test_accuracy": 0.7},
                   {"step": 8, "workers": [0], "batch": [8], "wall_time": 2.5, "test_accuracy": 0.9}])
    data = embedded(write_report([a, b, c], tmp_path / "out" / "compare.html"))
    assert [s["label"] for s in figure(data, "accuracy-round")["series"]] == ["fedavg: test accuracy",
                                                                            "scaffold: test accuracy"]
    assert {f["id"] for f in data["figures"]} >= {"accuracy-step", "worker-batch-3"}
    # target: the weakest run's best (scaffold, 0.65); fedavg gets there in round 2 (4 s), dp at step 4 (1 s)
    assert data["target_accuracy"] == 0.65
    summary = {s["run"]: s for s in data["summary"]}
    assert (summary["fedavg"]["final_accuracy"], summary["fedavg"]["best_accuracy"]) == (0.7, 0.8)
    assert (summary["fedavg"]["time_to_target"], summary["fedavg"]["reached_at"]) == (4.0, 2)
    assert (summary["fedavg"]["bytes"], summary["fedavg"]["wall_time"]) == (450, 6.0)
    assert (summary["scaffold"]["final_accuracy"], summary["scaffold"]["time_to_target"]) == (0.65, 2.0)
    assert summary["scaffold"]["bytes"] == 45
    assert (summary["dp"]["time_to_target"], summary["dp"]["bytes"], summary["dp"]["progress"]) == (1.0, None,
                                                                                                     "step 8 of 8")
    assert (tmp_path / "out" / "compare-accuracy-round.png").read_bytes().startswith(PNG)


class _Resources(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.urls += [v or "" for k, v in attrs if k in ("src", "href", "srcset", "poster", "data")]


def resources(html_text: str) -> list[str]:
    """Every URL the page's tags and styles name."""
    parser = _Resources()
    parser.feed(html_text)
    return parser.urls + re.findall(r"url\(([^)]*)\)", html_text)


def test_the_page_is_self_contained(federated_run: Path) -> None:
    urls = resources((federated_run / "report.html").read_text())
    assert urls and all(u.startswith("data:image/png;base64,") for u in urls)


def test_cli_report_of_a_missing_run_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["report", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"fedweave: error: {str(tmp_path / 'nope')!r} is not a run directory: it has no config.yaml"


def test_asp_updates_and_staleness_per_worker(tmp_path: Path) -> None:
    recs = [
        {"step": 4, "samples": 96, "window_time": 0.5, "workers": [0, 1], "updates": [1, 3], "batch": [24.0, 24.0],
         "compute_time": [0.5, 0.25], "idle_time": [None, 0.1], "staleness": [1.0, 0.5], "lost": [], "wall_time": 1.0},
        {"step": 8, "samples": 80, "window_time": 0.4, "workers": [0, 1], "updates": [2, 2], "batch": [16.0, 40.0],
         "compute_time": [0.5, 0.5], "idle_time": [0.2, 0.3], "staleness": [1.5, 1.0], "lost": [1], "wall_time": 2.0},
    ]
    run = write_run(tmp_path / "asp", {"name": "asp", "mode": "data_parallel",
                                       "data_parallel": {"sync": "asp", "epochs": 1}}, recs)
    data = embedded(write_report([run]))
    assert series(data, "worker-updates", "worker 1") == ([4, 8], [3, 2])
    assert series(data, "worker-staleness", "worker 0") == ([4, 8], [1.0, 1.5])
    assert series(data, "worker-idle", "worker 0") == ([8], [0.2])  # no idle time measured in its first window
    assert series(data, "worker-throughput", "worker 1") == ([4, 8], [96.0, 80.0])  # batch / compute time
    assert series(data, "throughput", "all workers") == ([4, 8], [192.0, 200.0])  # samples / window time
    assert figure(data, "worker-batch")["marks"] == [[8, "worker 1 left"]]  # lost by the parameter server


def test_run_names_are_drawn_as_written_not_as_mathtext() -> None:
    """Issue 26 item 10: a run folder named with ``$...$`` reached matplotlib as mathtext and a
    comparison report died in its parser."""
    from fedweave.observe.figures import Figure, Series
    from fedweave.observe.render import png

    odd = r"a$\frac{x$"
    drawn = png(Figure("acc", f"{odd} accuracy", "round", "$", [Series(f"{odd}: test_accuracy", [1, 2], [0.5, 0.6]),
                                                                Series("b: test_accuracy", [1, 2], [0.4, 0.7])]))
    assert drawn.startswith(b"\x89PNG")
