"""Robust aggregation: median, trimmed mean and (Multi-)Krum by hand, their config, and 2 Byzantine clients of 10."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from fedweave import config as config_mod
from fedweave import runner
from fedweave.config import AggregationConfig
from fedweave.errors import ConfigError, RoundError
from fedweave.schema import opt
from fedweave.strategies.aggregate import weighted_average
from fedweave.strategies.fedavg import FedAvg, FedAvgClient
from fedweave.strategies.robust import averager, coordinate_median, krum_scores, multi_krum, trimmed_mean
from fedweave.strategies.training import ClientJob
from fedweave.types import Params, Update

from conftest import assert_same_params, run_to_end


def sets(values: list[list[float]], counts: list[int] | None = None) -> list[Params]:
    """One tensor set per row: a float tensor ``v`` and an integer counter ``n``."""
    counts = counts or [0] * len(values)
    return [{"v": torch.tensor(row, dtype=torch.float64), "n": torch.tensor(c)} for row, c in zip(values, counts)]


def test_coordinate_median_by_hand() -> None:
    odd = sets([[1.0, 9.0], [5.0, -1.0], [3.0, 2.0]], counts=[4, 7, 2])
    assert_same_params(coordinate_median(odd, [1, 1, 100]), sets([[3.0, 2.0]], counts=[7])[0])
    even = sets([[1.0, 9.0], [5.0, -1.0], [3.0, 2.0], [4.0, 0.0]])
    assert_same_params(coordinate_median(even, [1, 2, 3, 4]), sets([[3.5, 1.0]])[0])


def test_trimmed_mean_by_hand() -> None:
    values = sets([[1.0, 10.0], [2.0, -50.0], [3.0, 0.0], [100.0, 2.0], [4.0, 4.0]])
    weights = [1, 1, 1, 1, 1]
    # β = 0.2 of 5 drops one value at each end: column 0 keeps 2, 3, 4; column 1 keeps 0, 2, 4
    assert_same_params(trimmed_mean(values, weights, fraction=0.2), sets([[3.0, 2.0]])[0])
    # β = 0.1 of 5 drops ⌊0.5⌋ = 0: the plain mean
    assert_same_params(trimmed_mean(values, weights, fraction=0.1), sets([[22.0, -6.8]])[0], atol=1e-12)


def test_trimmed_mean_without_trimming_is_the_mean_of_equal_weights() -> None:
    generator = torch.Generator().manual_seed(0)
    values = [{"a": torch.randn(3, 2, generator=generator), "b": torch.randn(4, generator=generator)} for _ in range(5)]
    assert_same_params(trimmed_mean(values, [7] * 5, fraction=0.0), weighted_average(values, [1] * 5), atol=1e-6)


def test_krum_and_multi_krum_by_hand() -> None:
    # points a..e in the plane, split over two tensors to check flattening; f = 1 keeps n − f − 2 = 2 neighbours
    points = [(0.0, 0.0), (1.0, 0.0), (0.0, 2.0), (2.0, 2.0), (10.0, 10.0)]
    updates = [
        {"x": torch.tensor([x]), "y": torch.tensor([y]), "n": torch.tensor(i)} for i, (x, y) in enumerate(points)
    ]
    # a: 1 (b) + 4 (c); b: 1 (a) + 5 (c or d); c: 4 (a) + 4 (d); d: 4 (c) + 5 (b); e: 128 (d) + 164 (c)
    assert krum_scores(updates, byzantine=1).tolist() == pytest.approx([5.0, 6.0, 8.0, 9.0, 292.0], rel=1e-12)
    weights = [1.0, 2.0, 3.0, 4.0, 100.0]
    assert_same_params(multi_krum(updates, weights, byzantine=1, select=1), updates[0])
    three = {"x": torch.tensor([2 / 6]), "y": torch.tensor([6 / 6]), "n": torch.tensor(2)}
    assert_same_params(multi_krum(updates, weights, byzantine=1, select=3), three, atol=1e-6)
    four = {"x": torch.tensor([10 / 10]), "y": torch.tensor([14 / 10]), "n": torch.tensor(3)}  # m = n − f
    assert_same_params(multi_krum(updates, weights, byzantine=1, select=None), four, atol=1e-6)


def test_krum_needs_more_than_2f_plus_2_updates() -> None:
    with pytest.raises(RoundError, match=r"byzantine=1 needs more than 2f \+ 2 = 4 updates, this round has 4"):
        multi_krum(sets([[0.0]] * 4), [1] * 4, byzantine=1, select=1)
    with pytest.raises(RoundError, match="selects m=6 updates, but this round has 5"):
        multi_krum(sets([[0.0]] * 5), [1] * 5, byzantine=1, select=6)


def test_config_names_the_rule_and_checks_its_settings() -> None:
    assert averager(AggregationConfig("median")) is coordinate_median
    assert averager(AggregationConfig("mean")) is weighted_average
    config = config_mod.load(None, ["aggregation={rule: multi_krum, byzantine: 2, multi_krum_m: 2}"])
    assert config.aggregation == AggregationConfig("multi_krum", byzantine=2, multi_krum_m=2)
    for override, message in [
        ("aggregation.rule=krumm", r"'krumm' is not allowed.*did you mean 'krum'"),
        ("aggregation.trim_fraction=0.5", r"'aggregation.trim_fraction': must be < 0.5"),
        ("aggregation.byzantine=-1", r"'aggregation.byzantine': must be >= 0"),
    ]:
        with pytest.raises(ConfigError, match=message):
            config_mod.load(None, [override])
    with pytest.raises(ConfigError, match=r"'aggregation.multi_krum_m': only rule 'multi_krum' uses it"):
        config_mod.load(None, ["aggregation.rule=krum", "aggregation.multi_krum_m=3"])


def test_trimmed_mean_of_nothing_is_fedavg_on_equal_clients(tmp_path: Path) -> None:
    trimmed, _ = run_to_end(tmp_path / "trimmed", "aggregation.rule=trimmed_mean", "aggregation.trim_fraction=0")
    mean, _ = run_to_end(tmp_path / "mean")
    assert_same_params(trimmed, mean, atol=1e-6)


# --------------------------------------------------------------------------- Byzantine clients


@dataclass
class ByzantineParams:
    scale: float = opt(-10.0, help="factor on the update of a Byzantine client (-1: sign flip)")
    byzantine: list[int] = opt(factory=lambda: [0, 1], help="ids of the Byzantine clients")


class ByzantineClient(FedAvgClient):
    """FedAvg, except that the Byzantine clients send their update times ``scale``."""

    def train(self, job: ClientJob) -> Update:
        update = super().train(job)
        if job.client_id not in self.hp.byzantine:
            return update
        tensors = {k: v * self.hp.scale if v.is_floating_point() else v for k, v in update.tensors.items()}
        return dataclasses.replace(update, tensors=tensors)


class ByzantineFedAvg(FedAvg):
    """FedAvg's server with clients 0 and 1 Byzantine; selected as ``strategy.name=<this module>:ByzantineFedAvg``."""

    Params = ByzantineParams
    Client = ByzantineClient


DIGITS = [
    "task.dataset=digits",
    "clients=10",
    "task.partition.scheme=iid",
    "task.model_options={hidden: [32]}",
    "rounds=5",
    "eval.every=0",
    "checkpoint.every=0",
]


def final_accuracy(tmp_path: Path, *overrides: str) -> float:
    r = runner.run_config(config_mod.load(None, [*DIGITS, f"output_dir={tmp_path}", *overrides]))
    return r.records[-1]["test_accuracy"]


@pytest.fixture(scope="module")
def clean_accuracy(tmp_path_factory: pytest.TempPathFactory) -> float:
    return final_accuracy(tmp_path_factory.mktemp("clean"))


def test_mean_collapses_under_two_scaled_byzantine_clients(tmp_path: Path, clean_accuracy: float) -> None:
    assert clean_accuracy > 0.85
    assert final_accuracy(tmp_path, f"strategy.name={__name__}:ByzantineFedAvg") < 0.3


@pytest.mark.parametrize("scale", [-10.0, -1.0])
@pytest.mark.parametrize(
    "rule",
    [
        ["aggregation.rule=median"],
        ["aggregation.rule=trimmed_mean", "aggregation.trim_fraction=0.2"],
        ["aggregation.rule=krum", "aggregation.byzantine=2"],
        ["aggregation.rule=multi_krum", "aggregation.byzantine=2"],
    ],
    ids=["median", "trimmed_mean", "krum", "multi_krum"],
)
def test_robust_rules_keep_the_clean_accuracy(
    tmp_path: Path, clean_accuracy: float, rule: list[str], scale: float
) -> None:
    strategy = f"strategy.name={__name__}:ByzantineFedAvg"
    attacked = final_accuracy(tmp_path, strategy, f"strategy.scale={scale}", *rule)
    assert attacked > clean_accuracy - 0.04
