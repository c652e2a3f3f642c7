"""FedNova: a_i for momentum SGD and the normalised server step by hand, equal steps are
FedAvg, config."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from conftest import assert_same_params, run_to_end, small_config
from fedweave.errors import ConfigError
from fedweave.strategies.base import StrategyContext
from fedweave.strategies.fedavg import FedAvg, FedAvgClient, FedAvgHParams
from fedweave.strategies.fednova import NORM, FedNova, FedNovaClient, FedNovaHParams
from fedweave.training import ClientJob
from fedweave.types import Params, Update, UpdateKind

from .conftest import tiny_data, tiny_job, tiny_params

LR = 0.1
X = tiny_params(0.8)


def task_loss(w: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = x @ w["features.weight"].T @ w["head.weight"].T + w["head.bias"]
    return ((out - y) ** 2).mean()


def momentum_sgd(x: torch.Tensor, y: torch.Tensor, steps: int, momentum: float) -> Params:
    """``steps`` full-batch steps of SGD with momentum from X (buffer starts at the first gradient)."""
    w, buf = X, None
    for _ in range(steps):
        leaves = {k: v.clone().requires_grad_() for k, v in w.items()}
        g = dict(zip(leaves, torch.autograd.grad(task_loss(leaves, x, y), list(leaves.values()))))
        buf = g if buf is None else {k: momentum * buf[k] + g[k] for k in g}
        w = {k: w[k] - LR * buf[k] for k in w}
    return w


def job(steps: int, momentum: float = 0.0, second: bool = False, **kw) -> ClientJob:
    j = tiny_job(X, local_steps=steps, lr=LR, momentum=momentum, **kw)
    if second:
        x, y = tiny_data()
        j = dataclasses.replace(j, client_id=1, x_train=1.5 - x[1:], y_train=2 * y[1:] + 0.5)
    return j


def test_unequal_steps_with_momentum_by_hand() -> None:
    client = FedNovaClient(FedNovaHParams())
    jobs = [job(2, 0.5), job(5, 0.5, second=True)]
    updates = [client.train(j) for j in jobs]
    a = [1 + 1.5, 1 + 1.5 + 1.75 + 1.875 + 1.9375]  # Σ_t Σ_{k<t} ρ^k: each gradient's total weight
    deltas = []
    for j, u, steps, a_i in zip(jobs, updates, (2, 5), a):
        y = momentum_sgd(j.x_train, j.y_train, steps, 0.5)
        deltas.append({k: y[k] - X[k] for k in X})
        assert_same_params(u.tensors, deltas[-1], atol=1e-12)
        assert u.extras[NORM].item() == pytest.approx(a_i, abs=1e-12)
    p = [4 / 7, 3 / 7]
    tau_eff = p[0] * a[0] + p[1] * a[1]
    new = FedNova(FedNovaHParams(), StrategyContext(num_clients=2)).aggregate(1, X, updates)
    for k in X:
        want = X[k] + tau_eff * (p[0] * deltas[0][k] / a[0] + p[1] * deltas[1][k] / a[1])
        torch.testing.assert_close(new[k], want, rtol=0, atol=1e-12)


def test_weight_decay_leaves_a_at_the_step_count() -> None:
    update = FedNovaClient(FedNovaHParams()).train(job(4, weight_decay=0.01))
    assert update.extras[NORM].item() == 4.0


def test_equal_steps_without_momentum_is_fedavg_exactly() -> None:
    nova = [FedNovaClient(FedNovaHParams()).train(job(3, second=s)) for s in (False, True)]
    plain = [FedAvgClient(FedAvgHParams()).train(job(3, second=s)) for s in (False, True)]
    for a, b in zip(nova, plain):
        assert_same_params(a.tensors, b.tensors)
    ctx = StrategyContext(num_clients=2)
    assert_same_params(
        FedNova(FedNovaHParams(), ctx).aggregate(1, X, nova), FedAvg(FedAvgHParams(), ctx).aggregate(1, X, plain)
    )


def test_run_with_equal_steps_is_the_fedavg_run(tmp_path: Path) -> None:
    same = ["local.steps=3", "local.momentum=0"]
    params, records = run_to_end(tmp_path / "n", "strategy.name=fednova", *same)
    expected, expected_records = run_to_end(tmp_path / "a", "strategy.name=fedavg", *same)
    assert_same_params(params, expected)
    for r, e in zip(records, expected_records):
        assert (r["train_loss"], r["test_accuracy"]) == (e["train_loss"], e["test_accuracy"])


def test_local_adam_is_refused() -> None:
    with pytest.raises(ValueError, match="FedNova"):
        FedNovaClient(FedNovaHParams()).train(job(2, optimizer="adam"))


def test_config_loads_and_rejects_unknown_keys() -> None:
    assert small_config("strategy.name=fednova").strategy.name == "fednova"
    with pytest.raises(ConfigError, match="strategy.mu"):
        small_config("strategy.name=fednova", "strategy.mu=0.1")


def test_running_statistics_take_the_plain_average() -> None:
    x = {"w": torch.tensor([1.0]), "bn.running_var": torch.tensor([1.0])}
    updates = [
        Update(
            kind=UpdateKind.DELTA,
            tensors={"w": torch.tensor([0.5]), "bn.running_var": torch.tensor([v])},
            num_examples=n,
            extras={NORM: torch.tensor(a, dtype=torch.float64)},
        )
        for v, n, a in ((-0.6, 1, 2.0), (-0.8, 3, 6.0))
    ]
    new = FedNova(FedNovaHParams(), StrategyContext(num_clients=2)).aggregate(1, x, updates)
    assert new["bn.running_var"].item() == pytest.approx(1 - (0.6 + 3 * 0.8) / 4)
    tau_eff = (2.0 + 3 * 6.0) / 4
    assert new["w"].item() == pytest.approx(1 + tau_eff * (0.5 / 2.0 + 3 * 0.5 / 6.0) / 4)


def claimed(delta: float, a: float, n: int) -> Update:
    return Update(
        kind=UpdateKind.DELTA,
        tensors={"w": torch.tensor([delta], dtype=torch.float64)},
        num_examples=n,
        extras={NORM: torch.tensor(a, dtype=torch.float64)},
    )


@pytest.mark.parametrize(
    ("rule", "want"),
    [
        # the mean: every claim counts, the huge a_i = 1000 blows the step up
        ("mean", 1.0 + (2 * 2 + 1 * 5 + 1 * 1000) / 4 * (2 * 0.4 / 2 + 1 * 1.0 / 5 + 1 * 50.0 / 1000) / 4),
        # Multi-Krum keeps clients 0 and 1: τ_eff = (2·2 + 1·5) / 3 over them alone
        ("multi_krum", 1.0 + (2 * 2 + 1 * 5) / 3 * (2 * 0.4 / 2 + 1 * 1.0 / 5) / 3),
        # the median of the a_i (5) times the median of the normalised steps (0.2)
        ("median", 1.0 + 5 * 0.2),
    ],
)
def test_a_robust_rule_takes_the_effective_steps_from_the_updates_it_trusts(rule: str, want: float) -> None:
    """Client 2 claims 1000 local steps and sends an outlying delta."""
    from fedweave.config import AggregationConfig
    from fedweave.strategies.robust import averager

    options = {"multi_krum": {"byzantine": 0, "multi_krum_m": 2}}.get(rule, {})
    average = averager(AggregationConfig(rule=rule, **options))
    updates = [claimed(0.4, 2, 2), claimed(1.0, 5, 1), claimed(50.0, 1000, 1)]
    x = {"w": torch.tensor([1.0], dtype=torch.float64)}
    new = FedNova(FedNovaHParams(), StrategyContext(num_clients=3, average=average)).aggregate(1, x, updates)
    assert new["w"].item() == pytest.approx(want, rel=1e-12)
