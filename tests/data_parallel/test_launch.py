"""Resuming and joining a data-parallel run (:mod:`fedweave.data_parallel.launch`): a checkpoint that
does not fit the saved config's model is one line naming the tensor and both shapes, before any worker
starts; a worker joined by hand that the run ends before admitting is done, not failed, when the run
finished."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from fedweave import cli
from fedweave import config as config_mod
from fedweave import data_parallel
from fedweave.data_parallel import elastic, group, launch
from fedweave.errors import CheckpointError

DP = [
    "mode=data_parallel",
    "task.dataset=synthetic",
    "task.dataset_options={samples: 250, features: 8, classes: 4}",
    "task.model_options={hidden: [16]}",
    "data_parallel.workers=2",
    "data_parallel.global_batch=50",
    "data_parallel.epochs=1",
    "data_parallel.timeout=10",
]


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished two-worker run (its checkpoint after its last step)."""
    run = tmp_path_factory.mktemp("dp") / "run"
    data_parallel.execute(data_parallel.prepare(config_mod.load(None, DP), run))
    return run


def edit(run: Path, hidden: list[int], epochs: int) -> None:
    path = run / "config.yaml"
    saved = yaml.safe_load(path.read_text())
    saved["task"]["model_options"]["hidden"] = hidden
    saved["data_parallel"]["epochs"] = epochs
    path.write_text(yaml.safe_dump(saved))


def test_a_checkpoint_of_another_model_is_one_line_naming_the_tensor_and_both_shapes(
    finished: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    assert data_parallel.resume(finished).start_step == 4  # 200 training samples, 50 a step
    edit(finished, [24], epochs=2)  # a second epoch to train: workers would start
    try:
        with pytest.raises(CheckpointError, match=r"tensor 'features.1.weight' has shape \[16, 8\] in the checkpoint but "
                                                  r"\[24, 8\] in the config's model"):
            data_parallel.resume(finished)
        capfd.readouterr()
        assert cli.main(["run", "--resume", str(finished)]) == 1
        out, err = capfd.readouterr()
        assert err.splitlines() == [
            f"fedweave: error: checkpoint in {str(finished)!r}: tensor 'features.1.weight' has shape [16, 8] in the checkpoint "
            "but [24, 8] in the config's model (was the config changed since?)"
        ]
        assert out == ""
    finally:
        edit(finished, [16], epochs=1)


def ended_run_store(run: Path) -> object:
    """The store of a launcher whose run has ended (``end`` set, two workers started), named in the
    run's rendezvous file as a running launcher names it."""
    store = group.launcher_store(10)
    store.add(elastic.WORKER_IDS_KEY, 2)
    store.set("end", "1")
    (run / launch.RENDEZVOUS_FILE).write_text(json.dumps({"host": "127.0.0.1", "port": store.port, "backend": "gloo"}))
    return store


def test_a_joiner_announced_after_the_last_step_of_a_finished_run_ends_cleanly(finished: Path) -> None:
    store = ended_run_store(finished)
    try:
        assert data_parallel.join(finished) == launch.Joined(worker=2, trained=False)
        assert store.get("join/1").decode() == "2,0"  # it did announce itself
        edit(finished, [16], epochs=2)  # the same ending, but the checkpoint is not the run's end: a failure
        with pytest.raises(data_parallel.DataParallelError, match="worker 3: the run ended before this worker was admitted"):
            data_parallel.join(finished)
    finally:
        edit(finished, [16], epochs=1)
        (finished / launch.RENDEZVOUS_FILE).unlink()
