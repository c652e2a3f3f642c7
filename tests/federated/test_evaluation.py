"""Tests of fedweave.federated.evaluation: the metrics aggregations, the server function, per-client records."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import small_config
from fedweave import config as config_mod
from fedweave import runner
from fedweave.build import build_task
from fedweave.config import ConfigError
from fedweave.federated.evaluation import EvaluationHooks, MetricPairs, weighted_mean
from fedweave.types import Params

HERE = __name__


def test_weighted_mean_of_the_metrics_every_client_reports() -> None:
    # loss (1 * 1 + 3 * 2) / 4; accuracy reported by one client only: left out
    assert weighted_mean([(1, {"loss": 1.0, "accuracy": 0.5}), (3, {"loss": 2.0})]) == {"loss": 1.75}
    assert weighted_mean([]) == {}


def largest(pairs: MetricPairs) -> dict[str, float]:
    """A user aggregation: the largest loss and the clients counted."""
    return {"loss": max(m["loss"] for _, m in pairs), "clients": len(pairs)}


def counted(pairs: MetricPairs) -> dict[str, float]:
    """A user aggregation of training metrics: the clients and examples counted, the largest train loss."""
    return {"clients": len(pairs), "examples": sum(n for n, _ in pairs), "loss": max(m["train_loss"] for _, m in pairs)}


def test_hooks_aggregate_by_the_users_function_and_record_each_client() -> None:
    hooks = EvaluationHooks(evaluate_aggregation=largest, per_client=True)
    record = hooks.federated_metrics([(3, 10, {"loss": 2.0}), (1, 30, {"loss": 0.5})])
    assert record == {
        "federated_loss": 2.0, "federated_clients": 2.0,
        "federated_per_client": {"1": {"num_examples": 30, "loss": 0.5}, "3": {"num_examples": 10, "loss": 2.0}},
    }
    fit = EvaluationHooks(fit_aggregation=counted).fit_metrics([(2, {"train_loss": 4.0}), (5, {"train_loss": 1.0})])
    assert fit == {"fit_clients": 2.0, "fit_examples": 7.0, "fit_loss": 4.0}
    with pytest.raises(ValueError, match="^eval.server_function returned loss='x', not a finite number$"):
        EvaluationHooks(server_function=lambda params: {"loss": "x"}).server_metrics({})


def weight_norm(params: Params) -> dict[str, float]:
    """A server-side evaluation: the norm of the global parameters."""
    return {"norm": float(torch.sqrt(sum((p.float() ** 2).sum() for p in params.values())))}


def test_a_run_records_the_hooks(tmp_path: Path) -> None:
    config = small_config(
        "rounds=2", "eval.federated_every=1", "eval.per_client=true",
        f"eval.server_function={HERE}:weight_norm", f"eval.fit_metrics_aggregation={HERE}:counted",
        f"eval.evaluate_metrics_aggregation={HERE}:largest", output=tmp_path,
    )
    r = runner.prepare(config, tmp_path / "run")
    records = runner.execute(r)
    last = records[-1]
    assert last["server_norm"] == pytest.approx(weight_norm(r.params)["norm"])
    assert last["fit_clients"] == last["federated_clients"] == config.clients
    task = build_task(config)
    assert last["fit_examples"] == sum(task.clients.train_size(c) for c in range(config.clients))
    per_client = last["federated_per_client"]
    assert sorted(per_client) == [str(c) for c in range(config.clients)]
    assert last["federated_loss"] == max(m["loss"] for m in per_client.values())
    assert "test_accuracy" in last and "federated_accuracy" not in last  # the user's function chose the keys


def test_hooks_are_checked_at_load() -> None:
    with pytest.raises(ConfigError, match="^config key 'eval.server_function': 'norm' is not of the form"):
        config_mod.load(None, ["eval.server_function=norm"])
    with pytest.raises(ConfigError, match="^config key 'eval.per_client': clients evaluate only with eval.federated_every > 0$"):
        config_mod.load(None, ["eval.per_client=true", "eval.federated_every=0"])
