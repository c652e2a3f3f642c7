"""Ditto: global and personal steps by hand, the global model is FedAvg's, personal evaluation, resume."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch

from fedweave import runner
from fedweave.strategies.base import StrategyContext
from fedweave.strategies.ditto import Ditto, DittoClient, DittoHParams
from fedweave.types import Params, TaskKind

from conftest import assert_same_params, comparable, run_interrupted, run_to_end, small_config

from .conftest import tiny_data, tiny_job, tiny_params

LR = 0.1
HP = DittoHParams(lam=0.3, personal_steps=3)


def tiny_mse(w: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = x @ w["features.weight"].T @ w["head.weight"].T + w["head.bias"]
    return ((out - y) ** 2).mean()


def descend(start: Params, objective: Callable[[Params], torch.Tensor], steps: int) -> Params:
    """Full-batch gradient descent on ``objective``."""
    w = {k: v.clone().requires_grad_(True) for k, v in start.items()}
    for _ in range(steps):
        grads = torch.autograd.grad(objective(w), list(w.values()))
        w = {k: (v - LR * g).detach().requires_grad_(True) for (k, v), g in zip(w.items(), grads)}
    return {k: v.detach() for k, v in w.items()}


def test_one_round_by_hand_client_and_server() -> None:
    glob, personal = tiny_params(), tiny_params(-0.5)
    x, y = tiny_data()
    client = DittoClient(HP)
    full = tiny_job(glob, local_steps=2, lr=LR, state={"personal": personal})
    job = tiny_job(glob, client_id=1, local_steps=2, lr=LR)
    three = dataclasses.replace(job, x_train=x[:3], y_train=y[:3])
    updates = [client.train(full), client.train(three)]

    deltas = []
    for update, (xs, ys) in zip(updates, [(x, y), (x[:3], y[:3])]):
        trained = descend(glob, lambda w: tiny_mse(w, xs, ys), 2)
        deltas.append({k: trained[k] - glob[k] for k in glob})
        assert_same_params(update.tensors, deltas[-1], atol=1e-10)

    def ditto_objective(v: Params, xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
        return tiny_mse(v, xs, ys) + HP.lam / 2 * sum(((v[k] - glob[k]) ** 2).sum() for k in v)

    assert_same_params(full.state["personal"], descend(personal, lambda v: ditto_objective(v, x, y), 3), atol=1e-10)
    first = descend(glob, lambda v: ditto_objective(v, x[:3], y[:3]), 3)  # a first round starts from the global
    assert_same_params(three.state["personal"], first, atol=1e-10)

    new = Ditto(HP, StrategyContext(num_clients=2)).aggregate(1, glob, updates)
    assert_same_params(new, {k: glob[k] + (4 * deltas[0][k] + 3 * deltas[1][k]) / 7 for k in glob}, atol=1e-10)


def test_evaluate_uses_the_personal_model() -> None:
    personal = tiny_params(-0.5)
    job = tiny_job(task=TaskKind.EVALUATE, state={"personal": personal})
    evaluation = DittoClient(HP).evaluate(job)
    x, y = tiny_data()
    assert abs(evaluation.metrics["loss"] - float(tiny_mse(personal, x, y))) < 1e-10


def test_global_model_is_fedavg(tmp_path: Path) -> None:
    ditto, ditto_records = run_to_end(tmp_path / "ditto", "strategy.name=ditto", "strategy.lam=1.0")
    fedavg, fedavg_records = run_to_end(tmp_path / "fedavg", "strategy.name=fedavg")
    assert_same_params(ditto, fedavg)
    assert comparable(ditto_records) == comparable(fedavg_records)


def test_personal_models_persist_and_are_evaluated(tmp_path: Path) -> None:
    r = runner.prepare(small_config("strategy.name=ditto", "eval.federated_every=1"), tmp_path)
    records = runner.execute(r)
    assert all("federated_accuracy" in record for record in records)
    states = r.store.state_dict()
    assert sorted(states) == [0, 1, 2, 3]
    heads = [states[c]["personal"]["head.weight"] for c in range(4)]
    assert not torch.equal(heads[0], heads[1])
    assert not torch.equal(heads[0], r.params["head.weight"])


def test_resume_is_identical(tmp_path: Path) -> None:
    straight, straight_records = run_to_end(tmp_path / "a", "strategy.name=ditto", "eval.federated_every=1")
    resumed, resumed_records = run_interrupted(tmp_path / "b", 1, "strategy.name=ditto", "eval.federated_every=1")
    assert_same_params(straight, resumed)
    assert comparable(straight_records) == comparable(resumed_records)
