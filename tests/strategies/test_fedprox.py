"""FedProx: the proximal local objective and the server step by hand, mu=0 is FedAvg, config."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from conftest import assert_same_params, comparable, run_to_end, small_config
from fedweave.errors import ConfigError
from fedweave.strategies.base import StrategyContext
from fedweave.strategies.fedavg import FedAvgClient, FedAvgHParams
from fedweave.strategies.fedprox import FedProx, FedProxClient, FedProxHParams
from fedweave.training import ClientJob
from fedweave.types import Params

from .conftest import tiny_data, tiny_job, tiny_params

LR, STEPS = 0.1, 3


def task_loss(w: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = x @ w["features.weight"].T @ w["head.weight"].T + w["head.bias"]
    return ((out - y) ** 2).mean()


def gradient_descent(w: Params, objective, steps: int, lr: float) -> Params:
    """Plain full-batch GD on ``objective``, its gradient by autograd."""
    for _ in range(steps):
        leaves = {k: v.clone().requires_grad_() for k, v in w.items()}
        grads = torch.autograd.grad(objective(leaves), list(leaves.values()))
        w = {k: v - lr * g for (k, v), g in zip(w.items(), grads)}
    return w


def second_client(job: ClientJob) -> ClientJob:
    """Three different samples for a second client."""
    x, y = tiny_data()
    return dataclasses.replace(job, client_id=1, x_train=1.5 - x[1:], y_train=2 * y[1:] + 0.5)


def test_one_round_by_hand() -> None:
    mu = 0.7
    received = tiny_params(0.8)
    jobs = [tiny_job(received, local_steps=STEPS, lr=LR), second_client(tiny_job(received, local_steps=STEPS, lr=LR))]
    client = FedProxClient(FedProxHParams(mu=mu))
    updates = [client.train(job) for job in jobs]
    expected_deltas = []
    for job, u in zip(jobs, updates):
        x, y = job.x_train, job.y_train

        def objective(w: Params) -> torch.Tensor:
            prox = sum(((w[k] - received[k]) ** 2).sum() for k in w)
            return task_loss(w, x, y) + mu / 2 * prox

        end = gradient_descent(received, objective, STEPS, LR)
        delta = {k: end[k] - received[k] for k in end}
        expected_deltas.append(delta)
        assert_same_params(u.tensors, delta, atol=1e-12)
        assert u.num_examples == len(y) and u.local_steps == STEPS
    strategy = FedProx(FedProxHParams(mu=mu), StrategyContext(num_clients=2))
    new = strategy.aggregate(1, received, updates)
    for k, w in received.items():
        want = w + (4 * expected_deltas[0][k] + 3 * expected_deltas[1][k]) / 7
        torch.testing.assert_close(new[k], want, rtol=0, atol=1e-12)


def test_reported_loss_is_the_task_loss() -> None:
    received = tiny_params(0.8)
    update = FedProxClient(FedProxHParams(mu=5.0)).train(tiny_job(received, local_steps=STEPS, lr=LR))
    x, y = tiny_data()

    def objective(w: Params) -> torch.Tensor:
        return task_loss(w, x, y) + 2.5 * sum(((w[k] - received[k]) ** 2).sum() for k in w)

    w, losses = received, []
    for _ in range(STEPS):
        losses.append(task_loss(w, x, y).item())
        w = gradient_descent(w, objective, 1, LR)
    assert update.metrics["train_loss"] == pytest.approx(sum(losses) / STEPS, abs=1e-12)


def test_mu_zero_is_fedavg_exactly() -> None:
    prox = FedProxClient(FedProxHParams(mu=0.0)).train(tiny_job(tiny_params(0.8), local_steps=STEPS))
    plain = FedAvgClient(FedAvgHParams()).train(tiny_job(tiny_params(0.8), local_steps=STEPS))
    assert_same_params(prox.tensors, plain.tensors)
    assert prox.metrics == plain.metrics


def test_run_with_mu_zero_is_the_fedavg_run(tmp_path: Path) -> None:
    params, records = run_to_end(tmp_path / "p", "strategy.name=fedprox", "strategy.mu=0")
    expected, expected_records = run_to_end(tmp_path / "a", "strategy.name=fedavg")
    assert_same_params(params, expected)
    assert comparable(records) == comparable(expected_records)


def test_config_loads_and_checks_ranges() -> None:
    assert small_config("strategy.name=fedprox", "strategy.mu=0.1").strategy.params.mu == 0.1
    with pytest.raises(ConfigError, match="strategy.mu"):
        small_config("strategy.name=fedprox", "strategy.mu=-1")
