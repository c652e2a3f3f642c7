"""Building a run refuses what cannot train before round 1, and leaves nothing behind."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import small_config
from fedweave import runner
from fedweave.build import build_task, initial_params
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


def test_the_initial_model_is_its_seed_s_while_another_thread_builds_a_model() -> None:
    """A server and its client nodes run as threads of one process (as the gRPC tests run them): a
    client that builds its model while the server draws the initial one draws from torch's global
    generator too. It must wait rather than draw from the server's seeded stream between its seed and
    its draws: the initial model, and the whole run, would otherwise depend on the threads' timing
    (a compressed gRPC run once ended on another model than its simulation, every entry)."""
    config = small_config()
    task = build_task(config)
    alone = initial_params(config, task)
    built = threading.Event()

    def client() -> None:
        task.make_model()  # what a client node's runtime builds
        built.set()

    thread = threading.Thread(target=client)

    def server_model() -> nn.Module:  # seeded: a client builds its model now, before the server draws
        thread.start()
        built.wait(1.0)
        return task.make_model()

    raced = initial_params(config, dataclasses.replace(task, make_model=server_model))
    thread.join(10)
    assert built.is_set()
    assert all(torch.equal(raced[k], alone[k]) for k in alone)
