"""Robust aggregation: median, trimmed mean and (Multi-)Krum by hand, their config, and 2 Byzantine clients of 10."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from fedweave import config as config_mod
from fedweave import runner
from fedweave.config import AggregationConfig
from fedweave.errors import ConfigError, RoundError
from fedweave.schema import opt
from fedweave.strategies import STRATEGIES
from fedweave.strategies.aggregate import Selected, kept_indices, weighted_average, with_selection
from fedweave.strategies.base import StrategyContext
from fedweave.strategies.fedavg import FedAvg, FedAvgClient
from fedweave.strategies.fednova import NORM
from fedweave.strategies.robust import averager, coordinate_median, krum_scores, multi_krum, trimmed_mean
from fedweave.training import ClientJob
from fedweave.types import Params, Update, UpdateKind

from conftest import assert_same_params, run_to_end

from .conftest import tiny_params


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
    # β = 0.1 of 5 drops ⌊0.5⌋ = 0: the plain mean; so does β = 0.15 (⌊0.75⌋ = 0, where rounding would drop 1)
    assert_same_params(trimmed_mean(values, weights, fraction=0.1), sets([[22.0, -6.8]])[0], atol=1e-12)
    assert_same_params(trimmed_mean(values, weights, fraction=0.15), sets([[22.0, -6.8]])[0], atol=1e-12)


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


def test_krum_names_the_updates_it_kept_the_coordinate_rules_keep_all() -> None:
    # the points of the test above, reordered: scores e 292, d 9, a 5, c 8, b 6
    points = [(10.0, 10.0), (2.0, 2.0), (0.0, 0.0), (0.0, 2.0), (1.0, 0.0)]
    updates = [{"x": torch.tensor([x]), "y": torch.tensor([y])} for x, y in points]
    weights = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert multi_krum(updates, weights, byzantine=1, select=1).kept == (2,)
    three = multi_krum(updates, weights, byzantine=1, select=3)
    assert three.kept == (2, 3, 4)  # scores 5, 8, 6: named in input order
    assert_same_params(three, {"x": torch.tensor([5 / 12]), "y": torch.tensor([8 / 12])}, atol=1e-6)
    assert multi_krum(updates, weights, byzantine=1, select=None).kept == (1, 2, 3, 4)  # m = n − f drops e
    for rule in (weighted_average, coordinate_median, functools.partial(trimmed_mean, fraction=0.2)):
        combined = rule(updates, weights)
        assert not isinstance(combined, Selected) and kept_indices(combined, 5) == [0, 1, 2, 3, 4]
    assert with_selection(three, {"z": torch.tensor([1.0])}).kept == (2, 3, 4)
    assert not isinstance(with_selection(updates[0], {"z": torch.tensor([1.0])}), Selected)


def strategy_updates(name: str) -> list[Update]:
    """Four updates of Tiny's shapes and equal examples, deltas s · tiny_params for
    s = 0.01, 3, −0.02, 0.03: update 1 lies far from the others. SCAFFOLD's carry
    Δc = −s/2 · tiny_params; FedNova's all the same a_i, so its scales are all 1."""
    out = []
    for cid, s in enumerate([0.01, 3.0, -0.02, 0.03]):
        extras = {"scaffold": tiny_params(-s / 2), "fednova": {NORM: torch.tensor(4.0, dtype=torch.float64)}}
        out.append(Update(UpdateKind.DELTA, tiny_params(s), 10, client_id=cid, extras=extras.get(name, {})))
    return out


@pytest.mark.parametrize("name", STRATEGIES.names())
def test_every_strategy_names_the_updates_krum_kept_and_steps_as_if_only_they_came(name: str) -> None:
    """Multi-Krum (f = 0, m = 3) of the four updates above keeps 0, 2, 3 (the distances
    lie on a line: client 1's two nearest are ≥ 2.97 away, the others' ≤ 0.05). The step
    names them, and equals the strategy's mean step over those three alone: the same new
    model and the same server state (SCAFFOLD's c and FedDyn's h move by 3/8 of the
    mean, not 4/8, with N = 8 clients)."""
    cls = STRATEGIES.get(name, "strategy.name")
    updates = strategy_updates(name)
    three_of_four = functools.partial(multi_krum, byzantine=0, select=3)
    krum = cls(cls.HParams(), StrategyContext(num_clients=8, average=three_of_four))
    mean = cls(cls.HParams(), StrategyContext(num_clients=8))
    got = krum.aggregate(1, tiny_params(), updates)
    assert kept_indices(got, 4) == [0, 2, 3]
    assert_same_params(got, mean.aggregate(1, tiny_params(), [updates[i] for i in (0, 2, 3)]), atol=1e-12)
    state, expected = krum.state_dict(), mean.state_dict()
    assert state.keys() == expected.keys()
    for key in state:
        assert_same_params(state[key], expected[key], atol=1e-12)
    if name in ("scaffold", "feddyn"):
        assert any(bool(t.abs().sum() > 0) for t in next(iter(state.values())).values())  # the state did move


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
class ByzantineHParams:
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

    HParams = ByzantineHParams
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
