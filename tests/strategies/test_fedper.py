"""FedPer: personal head by patterns, shared-layer deltas only, the server leaves the head alone."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from fedweave import runner
from fedweave.errors import TaskError
from fedweave.strategies.base import StrategyContext
from fedweave.strategies.fedper import FedPer, FedPerClient, FedPerHParams
from fedweave.types import Params, TaskKind

from conftest import assert_same_params, comparable, run_interrupted, run_to_end, small_config

from .conftest import tiny_data, tiny_job, tiny_params

LR = 0.1
HP = FedPerHParams(personal=["head.*"])
HEAD = ("head.weight", "head.bias")


def tiny_mse(w: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = x @ w["features.weight"].T @ w["head.weight"].T + w["head.bias"]
    return ((out - y) ** 2).mean()


def descend(start: Params, x: torch.Tensor, y: torch.Tensor, steps: int) -> Params:
    """Full-batch gradient descent on Tiny's MSE."""
    w = {k: v.clone().requires_grad_(True) for k, v in start.items()}
    for _ in range(steps):
        grads = torch.autograd.grad(tiny_mse(w, x, y), list(w.values()))
        w = {k: (v - LR * g).detach().requires_grad_(True) for (k, v), g in zip(w.items(), grads)}
    return {k: v.detach() for k, v in w.items()}


def test_one_round_by_hand_client_and_server() -> None:
    glob = tiny_params()
    own_head = {k: tiny_params(-2.0)[k] for k in HEAD}
    x, y = tiny_data()
    client = FedPerClient(HP)
    full = tiny_job(glob, local_steps=2, lr=LR, state={"local": own_head})
    job = tiny_job(glob, client_id=1, local_steps=2, lr=LR)
    three = dataclasses.replace(job, x_train=x[:3], y_train=y[:3])
    updates = [client.train(full), client.train(three)]

    trained = [descend({**glob, **own_head}, x, y, 2), descend(glob, x[:3], y[:3], 2)]
    for update, job, want in zip(updates, (full, three), trained):
        assert set(update.tensors) == {"features.weight"}
        expected = {"features.weight": want["features.weight"] - glob["features.weight"]}
        assert_same_params(update.tensors, expected, atol=1e-10)
        assert_same_params(job.state["local"], {k: want[k] for k in HEAD}, atol=1e-10)

    new = FedPer(HP, StrategyContext(num_clients=2)).aggregate(1, glob, updates)
    mean = (4 * trained[0]["features.weight"] + 3 * trained[1]["features.weight"]) / 7
    assert_same_params(new, {**glob, "features.weight": mean}, atol=1e-10)


def test_evaluate_uses_the_personal_head() -> None:
    own_head = {k: tiny_params(-2.0)[k] for k in HEAD}
    evaluation = FedPerClient(HP).evaluate(tiny_job(task=TaskKind.EVALUATE, state={"local": own_head}))
    x, y = tiny_data()
    assert abs(evaluation.metrics["loss"] - float(tiny_mse({**tiny_params(), **own_head}, x, y))) < 1e-10


def test_a_pattern_matching_nothing_is_a_clear_error() -> None:
    with pytest.raises(TaskError, match=r"pattern 'heda\.\*' matches no parameter of Tiny; its names are features"):
        FedPerClient(FedPerHParams(personal=["heda.*"])).train(tiny_job())


def test_no_personal_patterns_is_fedavg(tmp_path: Path) -> None:
    fedper, fedper_records = run_to_end(tmp_path / "fedper", "strategy.name=fedper", "strategy.personal=[]")
    fedavg, fedavg_records = run_to_end(tmp_path / "fedavg", "strategy.name=fedavg")
    assert_same_params(fedper, fedavg)
    assert comparable(fedper_records) == comparable(fedavg_records)


def test_personal_heads_persist_and_are_evaluated(tmp_path: Path) -> None:
    r = runner.prepare(small_config("strategy.name=fedper", "eval.federated_every=1"), tmp_path)
    initial = {k: v.clone() for k, v in r.params.items()}
    records = runner.execute(r)
    assert all("federated_accuracy" in record for record in records)
    states = r.store.state_dict()
    assert sorted(states) == [0, 1, 2, 3] and all(set(s["local"]) == set(HEAD) for s in states.values())
    assert not torch.equal(states[0]["local"]["head.weight"], states[1]["local"]["head.weight"])
    assert_same_params({k: r.params[k] for k in HEAD}, {k: initial[k] for k in HEAD})
    assert not torch.equal(r.params["features.1.weight"], initial["features.1.weight"])


def test_resume_is_identical(tmp_path: Path) -> None:
    straight, straight_records = run_to_end(tmp_path / "a", "strategy.name=fedper", "eval.federated_every=1")
    resumed, resumed_records = run_interrupted(tmp_path / "b", 1, "strategy.name=fedper", "eval.federated_every=1")
    assert_same_params(straight, resumed)
    assert comparable(straight_records) == comparable(resumed_records)
