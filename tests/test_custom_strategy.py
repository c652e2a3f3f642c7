"""The worked example of docs/custom-strategy.md: a user strategy selected by its import path.

``examples/custom_strategy.py`` is a user module, not part of fedweave: each test puts
the examples folder on ``sys.path`` (as ``PYTHONPATH=examples`` does for the CLI).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import nn

from conftest import assert_same_params, comparable, run_interrupted, run_to_end
from fedweave import config as config_mod
from fedweave import runner
from fedweave.build import build_strategy
from fedweave.errors import ConfigError
from fedweave.strategies.base import StrategyContext
from fedweave.strategies.fedavg import FedAvg, FedAvgHParams
from fedweave.training import ClientJob, LocalSettings
from fedweave.types import Instruction, Params, TaskKind, Update, UpdateKind, Work

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
CONFIG = EXAMPLES / "custom-strategy.yaml"
NAME = "custom_strategy:DecayedFedAvg"


@pytest.fixture
def example(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The example module, importable only while the test runs (it leaves no trace in
    ``sys.modules``, so other tests see the import path as a user's process would)."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    yield importlib.import_module("custom_strategy")
    sys.modules.pop("custom_strategy", None)


# --------------------------------------------------------------------------- config


def test_the_config_selects_it_by_import_path(example: ModuleType) -> None:
    config = config_mod.load(CONFIG)
    assert config.strategy.name == NAME
    assert config.strategy.params == example.DecayedFedAvgHParams(server_lr=1.0, decay=0.95)
    assert isinstance(build_strategy(config), example.DecayedFedAvg)


def test_its_settings_are_checked_when_the_config_loads(example: ModuleType) -> None:
    with pytest.raises(ConfigError, match=r"strategy\.decay"):
        config_mod.load(CONFIG, ["strategy.decay=1.5"])
    with pytest.raises(ConfigError, match=r"strategy.*dacay"):
        config_mod.load(CONFIG, ["strategy.dacay=0.9"])


def test_an_unimportable_module_is_one_clear_line() -> None:
    with pytest.raises(ConfigError, match="cannot import module 'no_such_module'"):
        config_mod.load(None, ["strategy.name=no_such_module:Strategy"])


# --------------------------------------------------------------------------- one round by hand


def linear(w: list[float], b: float) -> Params:
    return {
        "lin.weight": torch.tensor([w], dtype=torch.float64),
        "lin.bias": torch.tensor([b], dtype=torch.float64),
    }


class Linear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 1).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def tensor(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


CLIENT_DATA = [
    (tensor([[1.0, 2.0], [0.0, -1.0], [3.0, 1.0]]), tensor([[1.0], [0.0], [2.0]])),
    (tensor([[-2.0, 0.5]]), tensor([[-1.0]])),
]
"""Two clients: three samples and one sample."""


def job(params: Params, cid: int, rnd: int, steps: int, lr: float) -> ClientJob:
    x, y = CLIENT_DATA[cid]
    model = Linear()
    model.load_state_dict(params)
    return ClientJob(
        client_id=cid,
        instruction=Instruction(rnd, TaskKind.TRAIN, Work(cid, batch_size=len(x), local_steps=steps), params),
        model=model,
        x_train=x,
        y_train=y,
        x_test=x,
        y_test=y,
        loss_fn=mse,
        settings=LocalSettings(optimizer="sgd", lr=lr, momentum=0.0, weight_decay=0.0),
        generator=torch.Generator().manual_seed(0),
    )


def gradient_descent(params: Params, cid: int, steps: int, lr: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-batch GD on the mean squared error, written out: ∇w = 2/n·Xᵀr, ∇b = 2/n·Σr, r = Xw + b − y."""
    x, y = CLIENT_DATA[cid]
    w, b = params["lin.weight"].clone(), params["lin.bias"].clone()
    for _ in range(steps):
        r = x @ w.T + b - y
        w, b = w - lr * 2 / len(x) * (r.T @ x), b - lr * 2 / len(x) * r.sum(dim=0)
    return w, b


def test_one_round_by_hand(example: ModuleType) -> None:
    x0 = linear([0.5, -0.25], 0.1)
    rnd, steps, lr, server_lr, decay = 3, 2, 0.1, 0.5, 0.8
    client = example.DecayedFedAvgClient(example.DecayedFedAvgHParams())
    updates = [client.train(job(x0, cid, rnd, steps, lr)) for cid in (0, 1)]

    deltas = []
    for cid, update in enumerate(updates):
        w, b = gradient_descent(x0, cid, steps, lr)
        expected = {"lin.weight": w - x0["lin.weight"], "lin.bias": b - x0["lin.bias"]}
        assert update.kind is UpdateKind.DELTA
        assert update.num_examples == len(CLIENT_DATA[cid][0])
        assert update.local_steps == steps
        assert_same_params(update.tensors, expected, atol=1e-12)
        deltas.append(expected)

    server = example.DecayedFedAvg(example.DecayedFedAvgHParams(server_lr=server_lr, decay=decay), StrategyContext(2))
    x1 = server.aggregate(rnd, x0, updates)
    eta = server_lr * decay ** (rnd - 1)  # 0.32 in round 3
    for name in x0:
        mean = (3 * deltas[0][name] + 1 * deltas[1][name]) / 4
        torch.testing.assert_close(x1[name], x0[name] + eta * mean, rtol=0, atol=1e-12)


def test_running_statistics_take_the_mean_and_counters_the_max(example: ModuleType) -> None:
    params = {
        "w": torch.tensor([1.0, 2.0]),
        "bn.running_var": torch.tensor([1.0]),
        "bn.num_batches_tracked": torch.tensor(4),
    }
    deltas = [([0.4, 0.0], 0.2, 9), ([0.0, 0.8], 0.6, 7)]
    updates = [
        Update(
            UpdateKind.DELTA,
            {"w": torch.tensor(w), "bn.running_var": torch.tensor([v]), "bn.num_batches_tracked": torch.tensor(count)},
            num_examples=1,
        )
        for w, v, count in deltas
    ]
    server = example.DecayedFedAvg(example.DecayedFedAvgHParams(server_lr=0.5, decay=0.5), StrategyContext(2))
    new = server.aggregate(2, params, updates)  # η_2 = 0.25
    torch.testing.assert_close(new["w"], torch.tensor([1.05, 2.1]))
    torch.testing.assert_close(new["bn.running_var"], torch.tensor([1.4]))
    assert new["bn.num_batches_tracked"].item() == 9


def test_without_decay_it_is_fedavg_exactly(example: ModuleType) -> None:
    x0 = linear([0.5, -0.25], 0.1)
    client = example.DecayedFedAvgClient(example.DecayedFedAvgHParams())
    updates = [client.train(job(x0, cid, 1, 3, 0.1)) for cid in (0, 1)]
    ctx = StrategyContext(2)
    ours = example.DecayedFedAvg(example.DecayedFedAvgHParams(server_lr=1.0, decay=1.0), ctx).aggregate(7, x0, updates)
    assert_same_params(ours, FedAvg(FedAvgHParams(), ctx).aggregate(7, x0, updates))


# --------------------------------------------------------------------------- end to end


def test_the_example_config_runs(example: ModuleType, tmp_path: Path) -> None:
    config = config_mod.load(CONFIG, ["rounds=2", "eval.federated_every=2"])
    r = runner.prepare(config, tmp_path / "run")
    records = runner.execute(r)
    assert [rec["round"] for rec in records] == [1, 2]
    assert records[-1]["clients_completed"] == config.clients
    assert 0.0 <= records[-1]["test_accuracy"] <= 1.0
    assert 0.0 <= records[-1]["federated_accuracy"] <= 1.0


def test_in_a_run_without_decay_it_equals_fedavg(example: ModuleType, tmp_path: Path) -> None:
    ours, _ = run_to_end(tmp_path / "ours", f"strategy.name={NAME}", "strategy.decay=1.0")
    fedavg, _ = run_to_end(tmp_path / "fedavg", "strategy.name=fedavg")
    assert_same_params(ours, fedavg)
    decayed, _ = run_to_end(tmp_path / "decayed", f"strategy.name={NAME}", "strategy.decay=0.5")
    assert not torch.equal(decayed["head.bias"], fedavg["head.bias"])


def test_resume_gives_the_uninterrupted_run(example: ModuleType, tmp_path: Path) -> None:
    overrides = (f"strategy.name={NAME}", "strategy.server_lr=0.8", "strategy.decay=0.7")
    straight, straight_records = run_to_end(tmp_path / "straight", *overrides)
    resumed, resumed_records = run_interrupted(tmp_path / "resumed", 1, *overrides)
    assert_same_params(straight, resumed)
    assert comparable(resumed_records) == comparable(straight_records)
