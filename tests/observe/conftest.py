"""Run directories for the report tests: two real tiny runs (made once per session) and
hand-written ones (records chosen so the expectations can be computed by hand)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fedweave import cli
from conftest import SMALL

FEDERATED = [
    *SMALL, "clients=3", "heterogeneity.speeds=[1, 2, 4]", "eval.federated_every=2",
]
DATA_PARALLEL = [
    "mode=data_parallel", "task.dataset=synthetic", "task.dataset_options={samples: 600, features: 8, classes: 4}",
    "task.model_options={hidden: [16]}", "data_parallel.workers=2", "data_parallel.global_batch=48",
    "data_parallel.epochs=2", "data_parallel.lr=0.1", "data_parallel.log_every=2", "data_parallel.timeout=10",
    "data_parallel.controller.every=3", "heterogeneity.speeds=[1, 2]",
]


def cli_run(run_dir: Path, overrides: list[str]) -> Path:
    """``fedweave run -q --report`` of ``overrides`` into ``run_dir``."""
    assert cli.main(["run", *overrides, "--run-dir", str(run_dir), "-q", "--report"]) == 0
    return run_dir


@pytest.fixture(scope="session")
def federated_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cli_run(tmp_path_factory.mktemp("runs") / "fed", FEDERATED)


@pytest.fixture(scope="session")
def data_parallel_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cli_run(tmp_path_factory.mktemp("runs") / "dp", DATA_PARALLEL)


def write_run(run_dir: Path, config: dict[str, Any], records: list[dict[str, Any]], tail: str = "",
              partition: dict[str, Any] | None = None) -> Path:
    """A run directory as a run leaves it: config.yaml, metrics.jsonl (``tail`` appended
    as is, e.g. a torn line), partition.json."""
    import yaml

    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    if partition is not None:
        (run_dir / "partition.json").write_text(json.dumps(partition))
    return run_dir


def fed_record(rnd: int, acc: float | None, wall: float, sent: int = 100, received: int = 50, **extra: Any) -> dict[str, Any]:
    return {"round": rnd, "wall_time": wall, "train_loss": 1.0 / rnd, "test_accuracy": acc,
            "test_loss": None if acc is None else 1 - acc, "clients_sampled": 4, "clients_completed": 3,
            "bytes_sent": sent, "bytes_received": received, "skipped": False, "round_time": wall,
            "clients": None, **extra}


def embedded(html_path: Path) -> dict[str, Any]:
    """The JSON a report embeds."""
    text = html_path.read_text()
    start = text.index('<script type="application/json" id="fedweave-data">') + len(
        '<script type="application/json" id="fedweave-data">')
    return json.loads(text[start:text.index("</script>", start)].replace("<\\/", "</"))


def figure(data: dict[str, Any], fid: str) -> dict[str, Any]:
    (fig,) = [f for f in data["figures"] if f["id"] == fid]
    return fig


def series(data: dict[str, Any], fid: str, label: str) -> tuple[list[float], list[float]]:
    (s,) = [s for s in figure(data, fid)["series"] if s["label"] == label]
    return s["x"], s["y"]


SWEEP = ["rounds=3", "clients=3", "task.dataset=digits", "eval.federated_every=0", "checkpoint.every=0"]
"""A tiny sweep: digits, 3 clients, 3 rounds."""


@pytest.fixture(scope="session")
def sweep_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``fedweave sweep`` of 2 strategies x 3 seeds (in this process: one job at a time)."""
    folder = tmp_path_factory.mktemp("sweeps") / "sweep"
    args = ["sweep", *SWEEP, "--seeds", "1,2,3", "--grid", "strategy.name=fedavg,fedprox", "--jobs", "1",
            "--out", str(folder), "-q"]
    assert cli.main(args) == 0
    return folder
