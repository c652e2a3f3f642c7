"""Tests of fedweave.observe.loggers, .tensorboard and .mlflow: what TensorBoard's event
reader and MlflowClient read back is what metrics.jsonl holds."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from conftest import free_port, run_to_end, small_config
from fedweave import cli, runner
from fedweave import config as config_mod
from fedweave.errors import ConfigError
from fedweave.observe.flatten import scalars
from fedweave.observe.loggers import Loggers, open_loggers

from .conftest import DATA_PARALLEL, FEDERATED, fed_record, write_run


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


class Failing:
    def __init__(self) -> None:
        self.closed = False

    def record(self, step: int, record: Mapping[str, Any]) -> None:
        raise OSError("tracking server gone")

    def close(self, run_dir: Path, finished: bool) -> None:
        self.closed = True


class Keeping:
    def __init__(self) -> None:
        self.seen: list[tuple[int, dict[str, float]]] = []

    def record(self, step: int, record: Mapping[str, Any]) -> None:
        self.seen.append((step, scalars(record)))

    def close(self, run_dir: Path, finished: bool) -> None:
        pass


def test_a_failing_logger_is_dropped_and_the_others_go_on(caplog: pytest.LogCaptureFixture) -> None:
    failing, keeping = Failing(), Keeping()
    loggers = Loggers([failing, keeping], "round")
    loggers.record({"round": 1, "train_loss": 1.0})
    loggers.record({"round": 2, "train_loss": 0.5})
    assert keeping.seen == [(1, {"train_loss": 1.0}), (2, {"train_loss": 0.5})]
    assert "Failing failed (tracking server gone)" in caplog.text
    loggers.close(Path("."))
    assert not failing.closed


def event_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def expected(recs: list[dict], axis: str) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for r in recs:
        for key, value in scalars(r).items():
            out.setdefault(key, []).append((r[axis], pytest.approx(value, rel=1e-6, abs=1e-12)))
    return out


def test_tensorboard_events_hold_the_metrics_of_a_federated_run(tmp_path: Path) -> None:
    run_to_end(tmp_path / "run", "observe.tensorboard=true", "eval.federated_every=2")
    recs = records(tmp_path / "run")
    got = event_scalars(tmp_path / "run" / "tensorboard")
    assert {"test_accuracy", "train_loss", "bytes_sent", "federated_accuracy"} <= set(got)
    assert got == expected(recs, "round")
    assert got["federated_accuracy"] == [(2, pytest.approx(recs[1]["federated_accuracy"])),
                                         (3, pytest.approx(recs[2]["federated_accuracy"]))]


def test_tensorboard_and_mlflow_of_a_data_parallel_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # the default store needs no opt-in
    run = tmp_path / "dp"
    assert cli.main(["run", *DATA_PARALLEL, "observe.tensorboard=true", "observe.mlflow.experiment=dp-tests",
                     "--run-dir", str(run), "-q"]) == 0
    recs = records(run)
    got = event_scalars(run / "tensorboard")
    assert {"batch/worker_0", "batch/worker_1", "idle_time/worker_1", "train_loss"} <= set(got)
    assert got == expected(recs, "step")
    client = MlflowClient(tracking_uri=f"sqlite:///{run / 'mlflow.db'}")
    (found,) = client.search_runs([client.get_experiment_by_name("dp-tests").experiment_id])
    assert found.data.params["mode"] == "data_parallel" and found.data.params["data_parallel.workers"] == "2"
    history = client.get_metric_history(found.info.run_id, "batch/worker_1")
    assert [(m.step, m.value) for m in history] == [(r["step"], r["batch"][r["workers"].index(1)]) for r in recs]


def test_mlflow_run_has_params_metrics_per_round_and_artifacts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # the default store needs no opt-in
    run = tmp_path / "run"
    assert cli.main(["run", *FEDERATED, "observe.mlflow.enabled=true", "--run-dir", str(run), "-q"]) == 0
    recs = records(run)
    client = MlflowClient(tracking_uri=f"sqlite:///{run / 'mlflow.db'}")
    run_id = (run / "mlflow-run-id").read_text().strip()
    found = client.get_run(run_id)
    assert found.info.status == "FINISHED"
    assert client.get_experiment(found.info.experiment_id).name == "quickstart"  # the run's name
    params = found.data.params
    assert (params["rounds"], params["clients"], params["strategy.name"], params["heterogeneity.speeds"]) == (
        "3", "3", "fedavg", "[1.0, 2.0, 4.0]")
    for key in ("test_accuracy", "train_loss", "bytes_received", "round_time"):
        history = client.get_metric_history(run_id, key)
        assert [(m.step, m.value) for m in history] == [(r["round"], r[key]) for r in recs]
    top = {a.path for a in client.list_artifacts(run_id)}
    assert {"model.pt", "report"} <= top
    report = {a.path for a in client.list_artifacts(run_id, "report")}
    assert report == {"report/report.html"}  # its figures are inline
    assert (run / "mlartifacts").is_dir() and not (tmp_path / "mlruns").exists()  # artifacts beside the store
    # the installed MLflow reads the store back in a fresh process, its environment as it comes
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    code = (f"from mlflow.tracking import MlflowClient; c = MlflowClient(tracking_uri='sqlite:///{run / 'mlflow.db'}');"
            f"print(c.get_metric_history('{run_id}', 'test_accuracy')[-1].value)")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.split()[-1]) == recs[-1]["test_accuracy"]


def test_mlflow_logs_the_encrypted_model_a_deployed_he_server_writes(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A deployed server of plugin he writes model.he.pt and no model.pt: that file is the run's model."""
    import torch
    from mlflow.tracking import MlflowClient

    from fedweave.config import MlflowConfig
    from fedweave.observe.mlflow import MlflowLogger

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # the default store needs no opt-in
    run = write_run(tmp_path / "run", {"name": "he", "rounds": 1}, [fed_record(1, 0.5, 1.0)])
    torch.save({"w": torch.tensor([1, 2, 3], dtype=torch.uint8)}, run / "model.he.pt")
    logger = MlflowLogger(MlflowConfig(enabled=True), run, "he", {})
    logger.close(run, finished=True)
    client = MlflowClient(tracking_uri=f"sqlite:///{run / 'mlflow.db'}")
    top = {a.path for a in client.list_artifacts(logger.run_id)}
    assert "model.he.pt" in top and "model.pt" not in top
    got = torch.load(client.download_artifacts(logger.run_id, "model.he.pt", str(tmp_path)), weights_only=True)
    assert got["w"].tolist() == [1, 2, 3]


@pytest.mark.parametrize(
    ("override", "module", "extra"),
    [("observe.tensorboard=true", "torch.utils.tensorboard", "tensorboard"),
     ("observe.mlflow.enabled=true", "mlflow.tracking", "mlflow")],
)
def test_a_missing_extra_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, override: str, module: str,
                                  extra: str) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    with pytest.raises(ConfigError, match=rf"install it with pip install 'fedweave\[{extra}\]'"):
        open_loggers(small_config(override), tmp_path)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("observe.tensorboard=''", "config key 'observe.tensorboard': expected true, false or a folder, got ''"),
        ("observe.prometheus_port=70000", "config key 'observe.prometheus_port': must be <= 65535, got 70000"),
        ("observe.mlflow.experimnt=x", "unknown config key 'observe.mlflow.experimnt' (did you mean "
                                       "'observe.mlflow.experiment'?)"),
    ],
)
def test_observe_keys_are_checked_at_load(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        config_mod.load(None, [override])
    assert str(err.value).startswith(message)


def test_schema_lists_the_observe_keys(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["schema", "observe"]) == 0
    keys = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.startswith("observe")]
    assert keys == ["observe.tensorboard", "observe.mlflow.enabled", "observe.mlflow.tracking_uri",
                    "observe.mlflow.experiment", "observe.prometheus_port"]


def test_an_interrupted_run_marks_its_mlflow_run_failed_and_frees_the_endpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # the default store needs no opt-in
    port = free_port()
    r = runner.prepare(small_config("observe.mlflow.enabled=true", f"observe.prometheus_port={port}"), tmp_path / "run")

    def interrupt(record: dict[str, Any]) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        runner.execute(r, interrupt)
    run_id = (tmp_path / "run" / "mlflow-run-id").read_text().strip()
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'run' / 'mlflow.db'}")
    assert client.get_run(run_id).info.status == "FAILED"
    assert [m.step for m in client.get_metric_history(run_id, "train_loss")] == [1]
    with socket.socket() as s:  # the endpoint let its port go
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", port))
