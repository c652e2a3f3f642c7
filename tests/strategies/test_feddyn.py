"""FedDyn: the dynamic local objective, the client state and the server's h by hand; resume; config."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import assert_same_params, comparable, run_interrupted, run_to_end, small_config
from fedweave.errors import ConfigError
from fedweave.strategies.base import StrategyContext
from fedweave.strategies.feddyn import LINEAR, FedDyn, FedDynClient, FedDynHParams
from fedweave.types import Params, Update, UpdateKind

from .conftest import tiny_data, tiny_job, tiny_params

LR, STEPS, ALPHA = 0.1, 3, 0.3
X = tiny_params(0.8)


def task_loss(w: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = x @ w["features.weight"].T @ w["head.weight"].T + w["head.bias"]
    return ((out - y) ** 2).mean()


def dyn_descent(linear: Params) -> Params:
    """GD on L_k(θ) − ⟨linear, θ⟩ + α/2‖θ − X‖² from X, gradient by autograd."""
    x, y = tiny_data()
    w = X
    for _ in range(STEPS):
        leaves = {k: v.clone().requires_grad_() for k, v in w.items()}
        objective = task_loss(leaves, x, y) + sum(
            -(linear[k] * leaves[k]).sum() + ALPHA / 2 * ((leaves[k] - X[k]) ** 2).sum() for k in leaves
        )
        grads = torch.autograd.grad(objective, list(leaves.values()))
        w = {k: v - LR * g for (k, v), g in zip(w.items(), grads)}
    return w


@pytest.mark.parametrize("linear", [None, tiny_params(0.02)])
def test_client_round_by_hand(linear: Params | None) -> None:
    job = tiny_job(X, local_steps=STEPS, lr=LR, state=None if linear is None else {LINEAR: linear})
    update = FedDynClient(FedDynHParams(alpha=ALPHA)).train(job)
    previous = linear if linear is not None else {k: torch.zeros_like(v) for k, v in X.items()}
    theta = dyn_descent(previous)
    assert_same_params(update.tensors, {k: theta[k] - X[k] for k in X}, atol=1e-12)
    assert_same_params(job.state[LINEAR], {k: previous[k] - ALPHA * (theta[k] - X[k]) for k in X}, atol=1e-12)


def update(scale: float, counter: int, n: int) -> Update:
    tensors = {**tiny_params(scale), "bn.num_batches_tracked": torch.tensor(counter)}
    return Update(kind=UpdateKind.DELTA, tensors=tensors, num_examples=n)


def test_two_server_rounds_by_hand() -> None:
    """m = 4 clients, two of them per round; means are uniform whatever num_examples says."""
    strategy = FedDyn(FedDynHParams(alpha=ALPHA), StrategyContext(num_clients=4))
    x0 = {**X, "bn.num_batches_tracked": torch.tensor(1)}
    x1 = strategy.aggregate(1, x0, [update(0.1, 3, 1), update(-0.3, 2, 9)])
    x2 = strategy.aggregate(2, x1, [update(0.2, 5, 4), update(0.4, 4, 1)])
    for k, unit in tiny_params().items():
        h1 = -ALPHA / 4 * (0.1 - 0.3) * unit
        theta1 = X[k] + (0.1 - 0.3) / 2 * unit - h1 / ALPHA
        h2 = h1 - ALPHA / 4 * (0.2 + 0.4) * unit
        theta2 = theta1 + (0.2 + 0.4) / 2 * unit - h2 / ALPHA
        torch.testing.assert_close(x1[k], theta1, rtol=0, atol=1e-12)
        torch.testing.assert_close(x2[k], theta2, rtol=0, atol=1e-12)
        torch.testing.assert_close(strategy.state_dict()["h"][k], h2, rtol=0, atol=1e-12)
    assert (x1["bn.num_batches_tracked"].item(), x2["bn.num_batches_tracked"].item()) == (3, 5)


def test_resume_is_bit_identical(tmp_path: Path) -> None:
    params, records = run_interrupted(tmp_path / "r", 1, "strategy.name=feddyn", "sample_fraction=0.5")
    expected, expected_records = run_to_end(tmp_path / "e", "strategy.name=feddyn", "sample_fraction=0.5")
    assert_same_params(params, expected)
    assert comparable(records) == comparable(expected_records)


def test_config_loads_and_checks_ranges() -> None:
    assert small_config("strategy.name=feddyn", "strategy.alpha=0.1").strategy.params.alpha == 0.1
    with pytest.raises(ConfigError, match="strategy.alpha"):
        small_config("strategy.name=feddyn", "strategy.alpha=0")


def test_running_statistics_take_the_plain_average() -> None:
    strategy = FedDyn(FedDynHParams(alpha=ALPHA), StrategyContext(num_clients=4))
    x = {"w": torch.tensor([1.0]), "bn.running_var": torch.tensor([1.0])}
    deltas = [{"w": torch.tensor([0.5]), "bn.running_var": torch.tensor([v])} for v in (-0.6, -0.8)]
    new = strategy.aggregate(1, x, [Update(kind=UpdateKind.DELTA, tensors=d, num_examples=1) for d in deltas])
    assert new["bn.running_var"].item() == pytest.approx(0.3)
    assert set(strategy.h) == {"w"}
