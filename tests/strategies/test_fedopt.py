"""FedAdam, FedYogi, FedAdagrad: Algorithm 2 of Reddi et al. by hand, resume, config."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from conftest import assert_same_params, comparable, run_interrupted, run_to_end, small_config
from fedweave.errors import ConfigError
from fedweave.strategies import STRATEGIES
from fedweave.strategies.base import StrategyContext
from fedweave.strategies.fedavg import FedAvgClient
from fedweave.strategies.fedopt import FedAdagrad, FedAdagradHParams, FedAdam, FedOptHParams, FedYogi
from fedweave.types import Update, UpdateKind

NAMES = ["fedadam", "fedyogi", "fedadagrad"]


def scalar_update(delta: float, counter: int, n: int) -> Update:
    """An update of a one-number model (plus an integer counter)."""
    tensors = {"w": torch.tensor([delta], dtype=torch.float64), "steps": torch.tensor(counter)}
    return Update(kind=UpdateKind.DELTA, tensors=tensors, num_examples=n)


ROUNDS = [
    [scalar_update(0.4, 3, 1), scalar_update(-0.2, 8, 3)],  # mean -0.05
    [scalar_update(0.1, 4, 2), scalar_update(0.5, 2, 2)],  # mean 0.3
    [scalar_update(-0.02, 1, 1), scalar_update(0.0, 1, 1)],  # mean -0.01
]
MEANS = [-0.05, 0.3, -0.01]


def sign(x: float) -> int:
    return (x > 0) - (x < 0)


def by_hand(rule: str, lr: float, beta1: float, beta2: float, tau: float) -> list[float]:
    """Algorithm 2 on one scalar, written out: x after each round, from x = 1."""
    x, m, v, out = 1.0, 0.0, tau * tau, []
    for d in MEANS:
        m = beta1 * m + (1 - beta1) * d
        if rule == "adagrad":
            v = v + d * d
        elif rule == "yogi":
            v = v - (1 - beta2) * d * d * sign(v - d * d)
        else:
            v = beta2 * v + (1 - beta2) * d * d
        x = x + lr * m / (math.sqrt(v) + tau)
        out.append(x)
    return out


@pytest.mark.parametrize(
    ("rule", "cls", "hp"),
    [
        ("adam", FedAdam, FedOptHParams(server_lr=0.1, beta1=0.9, beta2=0.99, tau=1e-3)),
        ("yogi", FedYogi, FedOptHParams(server_lr=0.1, beta1=0.9, beta2=0.99, tau=1e-3)),
        ("adagrad", FedAdagrad, FedAdagradHParams(server_lr=0.1, beta1=0.9, tau=1e-3)),
    ],
)
def test_three_server_steps_by_hand(rule: str, cls: type, hp: object) -> None:
    strategy = cls(hp, StrategyContext(num_clients=2))
    expected = by_hand(rule, 0.1, 0.9, 0.99, 1e-3)
    params = {"w": torch.tensor([1.0], dtype=torch.float64), "steps": torch.tensor(0)}
    for rnd, (updates, want) in enumerate(zip(ROUNDS, expected), start=1):
        params = strategy.aggregate(rnd, params, updates)
        assert params["w"].item() == pytest.approx(want, abs=1e-12)
        assert params["steps"].item() == max(u.tensors["steps"].item() for u in updates)
    assert set(strategy.m) == set(strategy.v) == {"w"}


def test_yogi_second_moment_falls_additively() -> None:
    """On a shrinking pseudo-gradient Yogi's v falls by (1-β2)Δ², Adam's by (1-β2)(v - Δ²)."""
    hp = FedOptHParams(server_lr=0.1, beta1=0.0, beta2=0.5, tau=1e-3)
    adam, yogi = FedAdam(hp, StrategyContext(num_clients=2)), FedYogi(hp, StrategyContext(num_clients=2))
    params = {"w": torch.tensor([1.0], dtype=torch.float64), "steps": torch.tensor(0)}
    for strategy in (adam, yogi):
        p = strategy.aggregate(1, params, [scalar_update(1.0, 0, 1)])
        strategy.aggregate(2, p, [scalar_update(0.1, 0, 1)])
    assert adam.v["w"].item() == pytest.approx(0.5 * (0.5e-6 + 0.5) + 0.5 * 0.01, abs=1e-12)
    assert yogi.v["w"].item() == pytest.approx((1e-6 + 0.5) - 0.5 * 0.01, abs=1e-12)


@pytest.mark.parametrize("name", NAMES)
def test_clients_train_as_fedavg(name: str) -> None:
    assert STRATEGIES.get(name, "strategy.name").Client is FedAvgClient


@pytest.mark.parametrize("name", NAMES)
def test_resume_is_bit_identical(tmp_path: Path, name: str) -> None:
    params, records = run_interrupted(tmp_path / "r", 1, f"strategy.name={name}")
    expected, expected_records = run_to_end(tmp_path / "e", f"strategy.name={name}")
    assert_same_params(params, expected)
    assert comparable(records) == comparable(expected_records)


@pytest.mark.parametrize("name", NAMES)
def test_config_loads_and_checks_ranges(name: str) -> None:
    hp = small_config(f"strategy.name={name}", "strategy.server_lr=0.5", "strategy.tau=0.01").strategy.params
    assert (hp.server_lr, hp.tau) == (0.5, 0.01)
    with pytest.raises(ConfigError, match="strategy.beta1"):
        small_config(f"strategy.name={name}", "strategy.beta1=1")
    with pytest.raises(ConfigError, match="strategy.tau"):
        small_config(f"strategy.name={name}", "strategy.tau=0")


def test_adagrad_has_no_beta2() -> None:
    with pytest.raises(ConfigError, match="strategy.beta2"):
        small_config("strategy.name=fedadagrad", "strategy.beta2=0.9")
    with pytest.raises(ConfigError, match="strategy.beta2"):
        small_config("strategy.name=fedadam", "strategy.beta2=-0.1")


def test_running_statistics_take_the_plain_average() -> None:
    strategy = FedAdam(FedOptHParams(), StrategyContext(num_clients=2))
    x = {"w": torch.tensor([1.0]), "bn.running_var": torch.tensor([1.0])}
    deltas = [{"w": torch.tensor([0.5]), "bn.running_var": torch.tensor([v])} for v in (-0.6, -0.8)]
    new = strategy.aggregate(1, x, [Update(kind=UpdateKind.DELTA, tensors=d, num_examples=1) for d in deltas])
    assert new["bn.running_var"].item() == pytest.approx(0.3)
    assert set(strategy.m) == set(strategy.v) == {"w"}
