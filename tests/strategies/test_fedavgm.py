"""FedAvgM: server momentum by hand, the reduction to FedAvg, resume, config."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import assert_same_params, comparable, run_interrupted, run_to_end, small_config
from fedweave.errors import ConfigError
from fedweave.strategies.base import StrategyContext
from fedweave.strategies.fedavg import FedAvg, FedAvgClient, FedAvgHParams
from fedweave.strategies.fedavgm import FedAvgM, FedAvgMHParams
from fedweave.types import Params, Update, UpdateKind

from .conftest import tiny_params


def update(tensors: Params, n: int) -> Update:
    return Update(kind=UpdateKind.DELTA, tensors=tensors, num_examples=n)


def with_counter(params: Params, count: int) -> Params:
    return {**params, "bn.num_batches_tracked": torch.tensor(count)}


ROUNDS = [
    [update(with_counter(tiny_params(0.1), 7), 1), update(with_counter(tiny_params(-0.2), 9), 3)],
    [update(with_counter(tiny_params(0.3), 11), 2), update(with_counter(tiny_params(0.05), 10), 2)],
]
"""Two rounds of two clients' deltas; the integer buffer holds the clients' counters."""


def test_clients_train_as_fedavg() -> None:
    assert FedAvgM.Client is FedAvgClient


def test_two_rounds_of_server_momentum_by_hand() -> None:
    lr, beta = 0.5, 0.8
    strategy = FedAvgM(FedAvgMHParams(server_lr=lr, momentum=beta), StrategyContext(num_clients=2))
    x0 = with_counter(tiny_params(), 5)
    x1 = strategy.aggregate(1, x0, ROUNDS[0])
    x2 = strategy.aggregate(2, x1, ROUNDS[1])
    for name, w in tiny_params().items():
        mean1 = (1 * 0.1 + 3 * -0.2) / 4 * w  # every delta is a multiple of tiny_params()
        mean2 = (2 * 0.3 + 2 * 0.05) / 4 * w
        v1 = mean1
        v2 = beta * v1 + mean2
        torch.testing.assert_close(x1[name], w + lr * v1, rtol=0, atol=1e-12)
        torch.testing.assert_close(x2[name], w + lr * v1 + lr * v2, rtol=0, atol=1e-12)
    assert x1["bn.num_batches_tracked"].item() == 9
    assert x2["bn.num_batches_tracked"].item() == 11
    assert "bn.num_batches_tracked" not in strategy.velocity


def test_momentum_zero_is_fedavg_exactly() -> None:
    ctx = StrategyContext(num_clients=2)
    fedavgm = FedAvgM(FedAvgMHParams(server_lr=1.0, momentum=0.0), ctx)
    fedavg = FedAvg(FedAvgHParams(), ctx)
    a = b = with_counter(tiny_params(), 5)
    for rnd, updates in enumerate(ROUNDS, start=1):
        a, b = fedavgm.aggregate(rnd, a, updates), fedavg.aggregate(rnd, b, updates)
        assert_same_params(a, b)


def test_run_with_momentum_zero_is_the_fedavg_run(tmp_path: Path) -> None:
    params, records = run_to_end(tmp_path / "m", "strategy.name=fedavgm", "strategy.momentum=0")
    expected, expected_records = run_to_end(tmp_path / "a", "strategy.name=fedavg")
    assert_same_params(params, expected)
    assert comparable(records) == comparable(expected_records)


def test_running_statistics_take_the_plain_average() -> None:
    strategy = FedAvgM(FedAvgMHParams(server_lr=2.0, momentum=0.9), StrategyContext(num_clients=2))
    x = {"w": torch.tensor([1.0]), "bn.running_var": torch.tensor([1.0])}
    updates = [update({"w": torch.tensor([0.5]), "bn.running_var": torch.tensor([v])}, 1) for v in (-0.6, -0.8)]
    new = strategy.aggregate(1, x, updates)
    assert new["bn.running_var"].item() == pytest.approx(0.3)
    assert new["w"].item() == pytest.approx(2.0)
    assert set(strategy.velocity) == {"w"}

def test_resume_is_bit_identical(tmp_path: Path) -> None:
    params, records = run_interrupted(tmp_path / "r", 1, "strategy.name=fedavgm")
    expected, expected_records = run_to_end(tmp_path / "e", "strategy.name=fedavgm")
    assert_same_params(params, expected)
    assert comparable(records) == comparable(expected_records)


def test_config_loads_and_checks_ranges() -> None:
    hp = small_config("strategy.name=fedavgm", "strategy.momentum=0.5", "strategy.server_lr=2").strategy.params
    assert (hp.momentum, hp.server_lr) == (0.5, 2.0)
    with pytest.raises(ConfigError, match="strategy.momentum"):
        small_config("strategy.name=fedavgm", "strategy.momentum=1")
    with pytest.raises(ConfigError, match="strategy.server_lr"):
        small_config("strategy.name=fedavgm", "strategy.server_lr=0")
