"""Resuming a data-parallel run (:mod:`fedweave.data_parallel.launch`): a checkpoint that does not fit
the saved config's model is one line naming the tensor and both shapes, before any worker starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from fedweave import cli
from fedweave import config as config_mod
from fedweave import data_parallel
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
