"""FedAvg against hand computation: the clients' gradient steps and the server's weighted mean."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from fedweave.strategies.base import StrategyContext
from fedweave.strategies.fedavg import FedAvg, FedAvgClient, FedAvgHParams
from fedweave.types import TaskKind, Update, UpdateKind, Work

from .conftest import tiny_data, tiny_job, tiny_params

NumpyHParams = dict[str, np.ndarray]


def gradient_descent(
    params: NumpyHParams, x: np.ndarray, y: np.ndarray, lr: float, steps: int
) -> tuple[NumpyHParams, list[float]]:
    """Full-batch gradient descent on the MSE of Tiny (out = (x Wᵀ) hᵀ + b), gradients written out by hand."""
    w, h, b = (params[k].copy() for k in ("features.weight", "head.weight", "head.bias"))
    losses = []
    n = len(x)
    for _ in range(steps):
        z = x @ w.T  # (n, 2)
        residual = z @ h.T + b - y  # (n, 1)
        losses.append(float((residual**2).mean()))
        d_out = 2.0 * residual / n  # dL/d out
        grad_h = d_out.T @ z  # (1, 2)
        grad_b = d_out.sum(axis=0)  # (1,)
        grad_w = (d_out @ h).T @ x  # (2, 2)
        w, h, b = w - lr * grad_w, h - lr * grad_h, b - lr * grad_b
    return {"features.weight": w, "head.weight": h, "head.bias": b}, losses


def as_numpy(params: dict[str, torch.Tensor]) -> NumpyHParams:
    return {k: v.numpy().copy() for k, v in params.items()}


def test_configure_sends_the_global_params_to_every_planned_client() -> None:
    strategy = FedAvg(FedAvgHParams(), StrategyContext(num_clients=5))
    params = tiny_params()
    plan = [Work(1, 8), Work(3, 8, epochs=2), Work(4, 16, local_steps=3)]
    instructions = strategy.configure(7, params, plan)
    assert [i.work for i in instructions] == plan
    assert all(i.round == 7 and i.task is TaskKind.TRAIN and i.params is params for i in instructions)
    assert strategy.state_dict() == {}


def test_server_step_is_the_example_weighted_mean_of_deltas() -> None:
    strategy = FedAvg(FedAvgHParams(), StrategyContext(num_clients=2))
    params = {"w": torch.tensor([1.0, 1.0], dtype=torch.float64), "n": torch.tensor(2)}
    updates = [
        Update(UpdateKind.DELTA, {"w": torch.tensor([2.0, 0.0], dtype=torch.float64), "n": torch.tensor(4)}, 1),
        Update(UpdateKind.DELTA, {"w": torch.tensor([0.0, 4.0], dtype=torch.float64), "n": torch.tensor(5)}, 3),
    ]
    new = strategy.aggregate(1, params, updates)
    # w + (1·[2, 0] + 3·[0, 4]) / 4 = [1.5, 4]; the counter takes the largest value
    torch.testing.assert_close(new["w"], torch.tensor([1.5, 4.0], dtype=torch.float64), rtol=0, atol=1e-12)
    assert new["n"].item() == 5


def test_client_update_is_full_batch_gradient_descent() -> None:
    job = tiny_job(epochs=3, lr=0.05)
    update = FedAvgClient(FedAvgHParams()).train(job)
    x, y = (t.numpy() for t in tiny_data())
    expected, losses = gradient_descent(as_numpy(tiny_params()), x, y, lr=0.05, steps=3)
    assert update.kind is UpdateKind.DELTA and update.num_examples == 4 and update.local_steps == 3
    start = as_numpy(tiny_params())
    for name, value in expected.items():
        np.testing.assert_allclose(update.tensors[name].numpy(), value - start[name], rtol=0, atol=1e-12)
    assert abs(update.metrics["train_loss"] - np.mean(losses)) < 1e-12


def test_one_round_by_hand() -> None:
    """Two clients with 1 and 3 samples, two full-batch steps each, then the server's weighted mean."""
    x, y = tiny_data()
    shards = [(x[:1], y[:1]), (x[1:], y[1:])]
    strategy = FedAvg(FedAvgHParams(), StrategyContext(num_clients=2))
    global_params = tiny_params()
    instructions = strategy.configure(1, global_params, [Work(0, 4, epochs=2), Work(1, 4, epochs=2)])
    client = FedAvgClient(FedAvgHParams())
    updates = []
    for instruction, (xs, ys) in zip(instructions, shards):
        job = dataclasses.replace(tiny_job(lr=0.1, epochs=2), instruction=instruction, x_train=xs, y_train=ys)
        updates.append(client.train(job))
    new = strategy.aggregate(1, global_params, updates)

    start = as_numpy(global_params)
    trained = [gradient_descent(start, xs.numpy(), ys.numpy(), lr=0.1, steps=2)[0] for xs, ys in shards]
    assert [u.num_examples for u in updates] == [1, 3]
    for name in start:
        deltas = [t[name] - start[name] for t in trained]
        expected = start[name] + (1 * deltas[0] + 3 * deltas[1]) / 4
        np.testing.assert_allclose(new[name].numpy(), expected, rtol=0, atol=1e-6)
    assert global_params["head.bias"].item() == 0.1  # the global params the clients received are untouched


def test_evaluate_reports_the_local_test_split() -> None:
    job = tiny_job()
    evaluation = FedAvgClient(FedAvgHParams()).evaluate(job)
    assert evaluation.num_examples == 4
    assert set(evaluation.metrics) == {"loss", "accuracy"}
    empty = dataclasses.replace(job, x_test=job.x_test[:0], y_test=job.y_test[:0])
    nothing = FedAvgClient(FedAvgHParams()).evaluate(empty)
    assert (nothing.num_examples, nothing.metrics) == (0, {})
