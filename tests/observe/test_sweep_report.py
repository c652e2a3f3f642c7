"""The report of a sweep folder reads like a paper's figure: per grid point (a strategy) one mean
line with a band over its seeds, a legend of the grid points, the partition drawn once per distinct
one, no idle timeline for a plain simulation; a strategy's own metric has a figure."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from fedweave import cli
from fedweave.observe.figures import Figure, Series
from fedweave.observe.render import legend_labels
from fedweave.observe.report import write_report

from .conftest import SWEEP, embedded, figure
from .test_report import PNG
from .test_report_browser import CHROMIUM, check_in_browser

STRATEGIES = ("fedavg", "fedprox")


def accuracies(folder: Path, strategy: str) -> list[list[float]]:
    """Per seed, the test accuracy of each round, read from the run's metrics file."""
    return [[json.loads(line)["test_accuracy"] for line in
             (folder / f"strategy.name={strategy},seed={seed}" / "metrics.jsonl").read_text().splitlines()]
            for seed in (1, 2, 3)]


@pytest.fixture(scope="module")
def sweep_report(sweep_folder: Path) -> Path:
    """``fedweave report`` of the sweep folder (its default page, range bands), rendered once (a render
    draws every figure) for the tests that read that page."""
    assert cli.main(["report", str(sweep_folder)]) == 0
    return sweep_folder / "report.html"


def test_two_lines_with_bands_and_a_legend_of_two(sweep_folder: Path, sweep_report: Path) -> None:
    assert sweep_report == sweep_folder / "report.html"
    data = embedded(sweep_report)
    assert len(data["runs"]) == 6
    acc = figure(data, "accuracy-round")
    assert [s["label"] for s in acc["series"]] == [f"strategy={s}: test accuracy" for s in STRATEGIES]
    for s, strategy in zip(acc["series"], STRATEGIES):
        per_round = list(zip(*accuracies(sweep_folder, strategy)))
        assert s["x"] == [1, 2, 3] and s["runs"] == 3
        assert s["y"] == pytest.approx([statistics.fmean(v) for v in per_round])
        assert (s["low"], s["high"]) == ([min(v) for v in per_round], [max(v) for v in per_round])
    fig = Figure(**{**acc, "series": [Series(**s) for s in acc["series"]], "marks": []})
    assert legend_labels(fig) == ["strategy=fedavg", "strategy=fedprox"]
    groups = {g["label"]: g for g in data["groups"]}
    assert list(groups) == ["strategy=fedavg", "strategy=fedprox"]
    finals = [a[-1] for a in accuracies(sweep_folder, "fedprox")]
    assert groups["strategy=fedprox"]["final"]["test_accuracy"]["mean"] == pytest.approx(statistics.fmean(finals))
    assert groups["strategy=fedprox"]["final"]["test_accuracy"]["std"] == pytest.approx(statistics.stdev(finals))
    ids = [f["id"] for f in data["figures"]]
    # each seed draws its own partition, which both strategies share: drawn once per seed
    assert [i for i in ids if i.startswith("partition")] == ["partition-1", "partition-2", "partition-3"]
    assert figure(data, "partition-1")["title"].endswith("strategy.name=fedavg,seed=1, strategy.name=fedprox,seed=1")
    assert not [i for i in ids if i.startswith(("client-timeline", "client-idle"))]  # a plain simulation
    assert not list(sweep_folder.glob("**/*.png"))  # figures inline only


def test_the_standard_deviation_band_and_the_figures_folder(sweep_folder: Path, tmp_path: Path) -> None:
    page = write_report([sweep_folder], tmp_path / "std.html", figures_dir=tmp_path / "figures", band="std")
    (s, _) = figure(embedded(page), "accuracy-round")["series"]
    per_round = list(zip(*accuracies(sweep_folder, "fedavg")))
    stds = [statistics.stdev(v) for v in per_round]
    assert s["high"] == pytest.approx([m + d for m, d in zip(s["y"], stds)])
    assert (tmp_path / "figures" / "accuracy-round.png").read_bytes().startswith(PNG)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)")
def test_the_bands_are_on_the_screen(sweep_report: Path, tmp_path: Path) -> None:
    """In the browser's screenshot, the light blue and light orange of the two bands (tab:blue and
    tab:orange at alpha 0.2 over white) cover a visible area each."""
    import numpy as np
    from matplotlib.image import imread

    check_in_browser(sweep_report, tmp_path)  # the page loads whole; its screenshot is <tmp_path>/report.png
    shot = tmp_path / f"{sweep_report.stem}.png"
    pixels = (imread(shot)[..., :3] * 255).astype(int)
    for blue_band in ((210, 228, 240), (255, 229, 207)):
        close = np.abs(pixels - np.array(blue_band)).max(axis=-1) <= 4
        assert close.sum() > 2000


STRATEGY_MODULE = '''
from fedweave.strategies.fedavg import FedAvg


class CountingFedAvg(FedAvg):
    """FedAvg that reports how many updates it averaged in the round."""

    def aggregate(self, rnd, params, updates):
        self.averaged = len(updates)
        return super().aggregate(rnd, params, updates)

    def metrics(self):
        return {"averaged": float(self.averaged)}
'''


def test_a_strategy_metric_is_a_figure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "counting.py").write_text(STRATEGY_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    run = tmp_path / "run"
    assert cli.main(["run", *SWEEP, "strategy.name=counting:CountingFedAvg", "--run-dir", str(run), "-q",
                     "--report"]) == 0
    fig = figure(embedded(run / "report.html"), "metric-strategy_averaged")
    assert [(s["label"], s["x"], s["y"]) for s in fig["series"]] == [("strategy_averaged", [1, 2, 3], [3, 3, 3])]
