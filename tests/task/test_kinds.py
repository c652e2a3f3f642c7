"""Task kinds end to end: regression on diabetes and multi-label on the generated set, federated."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from fedweave import config as config_mod
from fedweave import runner
from fedweave.errors import TaskError
from fedweave.task import build_model, load_dataset

EXAMPLES = Path(__file__).parent.parent.parent / "examples"


def test_regression_on_diabetes_over_five_clients(tmp_path: Path) -> None:
    config = config_mod.load(EXAMPLES / "diabetes-regression.yaml", ["eval.every=5", "eval.federated_every=20"])
    records = runner.execute(runner.prepare(config, tmp_path / "run"))
    assert config.clients == 5 and len(records) == config.rounds == 20
    last = records[-1]
    assert last["test_r2"] > 0.35
    assert last["test_rmse"] ** 2 == pytest.approx(last["test_loss"], rel=1e-5)  # mse loss, rmse metric
    assert 0.0 < last["federated_mae"] <= last["federated_rmse"]


def test_multilabel_records_macro_f1_every_round(tmp_path: Path) -> None:
    config = config_mod.load(EXAMPLES / "multilabel.yaml", ["rounds=3"])
    records = runner.execute(runner.prepare(config, tmp_path / "run"))
    scores = [r["test_f1_macro"] for r in records]
    assert len(scores) == 3 and all(0.0 <= s <= 1.0 for s in scores)
    assert scores[-1] > 0.5 and records[-1]["test_auroc"] > 0.7


def test_builtin_datasets_of_the_kinds_and_the_models_outputs() -> None:
    diabetes = load_dataset("diabetes", seed=0, kind="regression")
    assert (len(diabetes.y_train), len(diabetes.y_test)) == (354, 88) and diabetes.num_classes == 1
    targets = torch.cat([diabetes.y_train, diabetes.y_test])
    assert float(targets.mean()) == pytest.approx(0.0, abs=1e-5) and float(targets.std(correction=0)) == pytest.approx(1.0)
    tags = load_dataset("multilabel", seed=0, kind="multilabel", options={"samples": 200, "labels": 3})
    assert tags.y_train.shape == (160, 3) and set(tags.y_train.unique().tolist()) == {0.0, 1.0}
    model = build_model("mlp", input_shape=tags.input_shape, num_classes=tags.num_classes, seed=0)
    assert model(tags.x_test).shape == (40, 3)
    with pytest.raises(TaskError, match="^dataset 'diabetes' is a regression task; set task.kind: regression$"):
        load_dataset("diabetes", seed=0)


def two_targets(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A user factory of a regression with two float targets."""
    x = np.random.default_rng(seed).normal(size=(40, 3))
    return x, np.stack([x[:, 0] + 0.5, x[:, 1] * x[:, 2]], axis=1)


def test_a_user_factory_gives_float_targets_of_any_width() -> None:
    data = load_dataset(f"{__name__}:two_targets", seed=0, kind="regression")
    assert data.y_train.dtype == torch.float32 and data.y_train.shape == (32, 2) and data.num_classes == 2
    with pytest.raises(TaskError, match="a multilabel task must hold 0 and 1 only"):
        load_dataset(f"{__name__}:two_targets", seed=0, kind="multilabel")
