"""The Python API runs, resumes, and gives the records the CLI writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

import fedweave
from conftest import SMALL, assert_same_params, comparable
from fedweave import config as config_mod
from fedweave import rundir, runner
from fedweave.cli import main
from fedweave.errors import ConfigError


def small_yaml(tmp_path: Path) -> Path:
    path = tmp_path / "small.yaml"
    data = fedweave.load_config(None, [*SMALL, "rounds=3", "checkpoint.every=1"])
    path.write_text(config_mod.to_yaml(data))
    return path


def test_load_config_takes_a_path_a_mapping_or_the_quickstart(tmp_path: Path) -> None:
    path = small_yaml(tmp_path)
    from_path = fedweave.load_config(path, ["rounds=2"])
    from_mapping = fedweave.load_config(yaml.safe_load(path.read_text()), ["rounds=2"])
    assert from_path == from_mapping and from_path.rounds == 2
    assert fedweave.load_config().name == "quickstart"
    with pytest.raises(ConfigError, match="config key 'rounds'"):
        fedweave.load_config({"rounds": 0})


def test_run_returns_the_records_model_and_directory_the_cli_writes(tmp_path: Path) -> None:
    path = small_yaml(tmp_path)
    r = fedweave.run(fedweave.load_config(path), tmp_path / "api")
    assert r.run_dir == tmp_path / "api" and [x["round"] for x in r.records] == [1, 2, 3]
    assert_same_params(r.params, rundir.load_model(r.run_dir))
    assert main(["run", str(path), "-q", "--run-dir", str(tmp_path / "cli")]) == 0
    cli_records = [json.loads(line) for line in (tmp_path / "cli" / rundir.METRICS_FILE).read_text().splitlines()]
    assert comparable(cli_records) == comparable(r.records)
    assert_same_params(rundir.load_model(tmp_path / "cli"), r.params)


def test_resume_continues_an_interrupted_run_to_the_same_end(tmp_path: Path) -> None:
    path = small_yaml(tmp_path)
    whole = fedweave.run(path, tmp_path / "whole")
    interrupted = runner.prepare(fedweave.load_config(path), tmp_path / "cut")

    def stop_after_round_1(record: dict) -> None:
        if record["round"] == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        runner.execute(interrupted, stop_after_round_1)
    resumed = fedweave.resume(tmp_path / "cut")
    assert [x["round"] for x in resumed.records] == [1, 2, 3]
    assert comparable(resumed.records) == comparable(whole.records)
    assert_same_params(resumed.params, whole.params)
    again = fedweave.resume(tmp_path / "cut")  # a finished run: nothing left to do
    assert again.first_round == 4 and comparable(again.records) == comparable(whole.records)


def test_run_and_resume_dispatch_a_data_parallel_config_by_its_mode(tmp_path: Path) -> None:
    """`fedweave.run` ran every config through the federated runner, which refused `mode: data_parallel`;
    it dispatches by mode as `fedweave run` does, and so does `fedweave.resume`."""
    from fedweave.data_parallel import DataParallelRun

    config = fedweave.load_config(None, [
        "mode=data_parallel", "task.dataset=synthetic", "task.dataset_options={samples: 200, features: 8, classes: 4}",
        "task.model_options={hidden: [8]}", "data_parallel.workers=2", "data_parallel.global_batch=40",
        "data_parallel.epochs=1", "data_parallel.log_every=2", "data_parallel.timeout=30",
    ])
    r = fedweave.run(config, tmp_path / "dp")
    assert isinstance(r, DataParallelRun) and r.run_dir == tmp_path / "dp"
    assert [x["step"] for x in r.records] == [2, 4]  # 160 training samples, 40 a step: 4 steps
    assert (tmp_path / "dp" / rundir.MODEL_FILE).is_file()
    again = fedweave.resume(tmp_path / "dp")  # finished: nothing to do
    assert isinstance(again, DataParallelRun) and again.finished and again.records == r.records
