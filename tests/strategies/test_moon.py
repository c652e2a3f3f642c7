"""MOON: the contrastive client step by hand, FedAvg server, mu=0 reduction, resume, model check."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

from fedweave.errors import TaskError
from fedweave.strategies.base import StrategyContext
from fedweave.strategies.fedavg import FedAvgClient, FedAvgHParams
from fedweave.strategies.moon import Moon, MoonClient, MoonHParams
from fedweave.types import Params

from conftest import assert_same_params, comparable, run_interrupted, run_to_end

from .conftest import tiny_data, tiny_job, tiny_params

HP = MoonHParams(mu=0.7, temperature=0.5)
LR = 0.1


def cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1))


def moon_objective(w: Params, glob: Params, prev: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """MSE of Tiny plus μ·ℓ_con, written from the paper's equations."""
    z, z_glob, z_prev = x @ w["features.weight"].T, x @ glob["features.weight"].T, x @ prev["features.weight"].T
    out = z @ w["head.weight"].T + w["head.bias"]
    pos = torch.exp(cos(z, z_glob) / HP.temperature)
    neg = torch.exp(cos(z, z_prev) / HP.temperature)
    contrastive = -torch.log(pos / (pos + neg)).mean()
    return ((out - y) ** 2).mean() + HP.mu * contrastive


def hand_delta(glob: Params, prev: Params, x: torch.Tensor, y: torch.Tensor, steps: int) -> Params:
    """Full-batch gradient descent on the MOON objective; returns w − w_glob."""
    w = {k: v.clone().requires_grad_(True) for k, v in glob.items()}
    for _ in range(steps):
        grads = torch.autograd.grad(moon_objective(w, glob, prev, x, y), list(w.values()))
        w = {k: (v - LR * g).detach().requires_grad_(True) for (k, v), g in zip(w.items(), grads)}
    return {k: w[k].detach() - glob[k] for k in glob}


def test_one_round_by_hand_client_and_server() -> None:
    glob, prev = tiny_params(), tiny_params(0.5)
    x, y = tiny_data()
    client = MoonClient(HP)
    full = tiny_job(glob, local_steps=2, lr=LR, state={"previous": prev})
    job = tiny_job(glob, client_id=1, local_steps=2, lr=LR, state={"previous": prev})
    three = dataclasses.replace(job, x_train=x[:3], y_train=y[:3])
    updates = [client.train(full), client.train(three)]

    expected = [hand_delta(glob, prev, x, y, 2), hand_delta(glob, prev, x[:3], y[:3], 2)]
    for update, want in zip(updates, expected):
        assert_same_params(update.tensors, want, atol=1e-10)
    trained = {k: glob[k] + expected[0][k] for k in glob}
    assert_same_params(full.state["previous"], trained, atol=1e-10)

    new = Moon(HP, StrategyContext(num_clients=2)).aggregate(1, glob, updates)
    assert_same_params(new, {k: glob[k] + (4 * expected[0][k] + 3 * expected[1][k]) / 7 for k in glob}, atol=1e-10)


def test_first_round_has_no_negative_and_is_plain_local_training() -> None:
    moon_job, fedavg_job = tiny_job(local_steps=3), tiny_job(local_steps=3)
    update = MoonClient(HP).train(moon_job)
    assert_same_params(update.tensors, FedAvgClient(FedAvgHParams()).train(fedavg_job).tensors)
    assert_same_params(moon_job.state["previous"], fedavg_job.model.state_dict())


def test_mu_zero_is_fedavg(tmp_path: Path) -> None:
    moon_params, moon_records = run_to_end(tmp_path / "moon", "strategy.name=moon", "strategy.mu=0")
    fedavg_params, fedavg_records = run_to_end(tmp_path / "fedavg", "strategy.name=fedavg")
    assert_same_params(moon_params, fedavg_params)
    assert comparable(moon_records) == comparable(fedavg_records)


def test_resume_is_identical(tmp_path: Path) -> None:
    straight, straight_records = run_to_end(tmp_path / "a", "strategy.name=moon")
    resumed, resumed_records = run_interrupted(tmp_path / "b", 1, "strategy.name=moon")
    assert_same_params(straight, resumed)
    assert comparable(straight_records) == comparable(resumed_records)


def test_model_without_representation_is_a_clear_error() -> None:
    job = tiny_job()
    job.model = nn.Sequential(nn.Linear(2, 1)).double()
    with pytest.raises(TaskError, match=r"'moon'.*Sequential must expose features\(x\).*head\(z\)"):
        MoonClient(HP).train(job)
