"""Building a run refuses what cannot train before round 1, and leaves nothing behind."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn

from conftest import small_config
from fedweave import runner
from fedweave.errors import TaskError


def plain_model(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """A model without the ``features`` / ``head`` split MOON needs."""
    return nn.Sequential(nn.Flatten(), nn.Linear(input_shape[0], num_classes))


def test_fedper_pattern_matching_nothing_is_refused_before_round_one(tmp_path: Path) -> None:
    config = small_config("strategy.name=fedper", "strategy.personal=[classifier.*]")
    with pytest.raises(TaskError, match="personal pattern 'classifier.\\*' matches no parameter"):
        runner.prepare(config, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_moon_refuses_a_model_without_a_representation(tmp_path: Path) -> None:
    config = small_config("strategy.name=moon", "task.model=test_build:plain_model", "task.model_options={}")
    with pytest.raises(TaskError, match="features"):
        runner.prepare(config, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_directory_the_user_filled_is_kept_when_the_build_fails(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    config = small_config("strategy.name=fedper", "strategy.personal=[nothing.*]")
    with pytest.raises(TaskError):
        runner.prepare(config, tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_model_options_a_factory_does_not_take_are_a_task_error(tmp_path: Path) -> None:
    config = small_config("task.model=test_build:plain_model")  # the small config passes hidden=[16]
    with pytest.raises(TaskError, match="model 'test_build:plain_model'.*hidden.*task.model_options"):
        runner.prepare(config, tmp_path / "run")
