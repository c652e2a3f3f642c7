"""Tests of fedweave.federated.selection: seeded sampling of distinct clients, and the selections
(uniform, power-of-choice, Oort) choosing what a hand computation on a fixed loss table says."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
import torch

from conftest import assert_same_params, comparable, run_interrupted, run_to_end, small_config
from fedweave.federated.controller import StaticController
from fedweave.federated.selection import Oort, PowerOfChoice, Uniform, oort_utility, percentile, sample_clients
from fedweave.build import build_controller
from fedweave.config import SelectionConfig
from fedweave.errors import ConfigError
from fedweave.seeding import numpy_rng
from fedweave.types import Update, UpdateKind


def test_distinct_sorted_ids_in_range() -> None:
    for rnd in range(1, 30):
        ids = sample_clients(numpy_rng(0, "sample", rnd), 50, 7)
        assert len(ids) == 7 and len(set(ids)) == 7
        assert ids == sorted(ids) and all(0 <= i < 50 for i in ids)
        assert all(type(i) is int for i in ids)


def test_seeded() -> None:
    assert sample_clients(numpy_rng(0, "sample", 1), 10, 3) == [2, 3, 6]
    assert sample_clients(numpy_rng(0, "sample", 1), 10, 3) == sample_clients(numpy_rng(0, "sample", 1), 10, 3)
    rounds = {tuple(sample_clients(numpy_rng(0, "sample", r), 100, 10)) for r in range(1, 11)}
    assert len(rounds) == 10


def test_all_clients_when_count_is_everyone() -> None:
    assert sample_clients(numpy_rng(0), 4, 4) == [0, 1, 2, 3]


def test_every_client_is_chosen_about_as_often() -> None:
    counts = Counter(i for r in range(2000) for i in sample_clients(numpy_rng(1, "sample", r), 10, 3))
    assert set(counts) == set(range(10))
    # 600 expected each (2000 rounds × 3 / 10); the binomial standard deviation is about 20
    assert all(500 < c < 700 for c in counts.values())


@pytest.mark.parametrize("count", [0, 11, -1])
def test_impossible_counts(count: int) -> None:
    with pytest.raises(ValueError, match=f"cannot sample {count} of 10 clients"):
        sample_clients(numpy_rng(0), 10, count)


def test_sampling_costs_the_sampled_clients_not_the_population() -> None:
    """100 of 10^12 clients: anything that touched every id would need terabytes."""
    ids = sample_clients(numpy_rng(0, "sample", 1), 10**12, 100)
    assert len(set(ids)) == 100 and ids == sorted(ids) and all(0 <= i < 10**12 for i in ids)
    assert ids == sample_clients(numpy_rng(0, "sample", 1), 10**12, 100)


def test_absent_clients_are_never_sampled_and_the_present_ones_stay_uniform() -> None:
    """Clients a transport knows are gone are replaced by present ones: 3 of the 8 present of
    10 each round, every present one chosen about as often (2000 × 3 / 8 = 750 expected, the
    binomial standard deviation about 22)."""
    absent = {2, 7}
    counts: Counter[int] = Counter()
    for r in range(2000):
        ids = sample_clients(numpy_rng(1, "sample", r), 10, 3, absent)
        assert len(ids) == 3 and ids == sorted(set(ids)) and not absent & set(ids)
        counts.update(ids)
    assert set(counts) == set(range(10)) - absent
    assert all(650 < c < 850 for c in counts.values())


def test_with_nobody_absent_the_draw_is_the_plain_one() -> None:
    """A run where nobody is gone (every simulation) samples bit for bit as without the argument."""
    for r in range(1, 50):
        assert sample_clients(numpy_rng(3, "sample", r), 20, 5, ()) == sample_clients(numpy_rng(3, "sample", r), 20, 5)
        assert sample_clients(numpy_rng(3, "sample", r), 20, 5, {25, -1}) == sample_clients(numpy_rng(3, "sample", r), 20, 5)
    assert sample_clients(numpy_rng(0, "sample", 1), 10, 3, set()) == [2, 3, 6]


def test_fewer_present_clients_than_the_count_are_all_sampled() -> None:
    assert sample_clients(numpy_rng(0), 4, 3, {1, 2}) == [0, 3]
    assert sample_clients(numpy_rng(0), 4, 4, {2}) == [0, 1, 3]
    assert sample_clients(numpy_rng(0), 4, 2, {0, 1, 2, 3}) == []
    ids = sample_clients(numpy_rng(0, "sample", 1), 10**12, 100, {5, 10**11})  # still O(count) of a huge population
    assert len(ids) == 100 and 5 not in ids and 10**11 not in ids


# --------------------------------------------------------------------------- selections

LOSSES = [0.2, 1.5, 0.9, 2.4, 0.1, 1.1]
"""The fixed loss table: client i last reported a mean training loss LOSSES[i]."""


def update(cid: int, loss: float, examples: int = 100, compute: float = 1.0) -> Update:
    return Update(kind=UpdateKind.WEIGHTS, client_id=cid, tensors={"w": torch.zeros(1)}, num_examples=examples,
                  metrics={"train_loss": loss}, compute_time=compute)


def test_uniform_draws_what_fedweave_always_drew() -> None:
    """Pinned: the ids of the sampling before selection became a protocol (and a config's uniform)."""
    assert [Uniform().select(r, numpy_rng(0, "sample", r), 10, 3) for r in (1, 2, 3)] == [[2, 3, 6], [4, 6, 9],
                                                                                         [0, 6, 9]]
    assert Uniform().select(1, numpy_rng(7, "sample", 1), 100, 5, {3, 50}) == [26, 30, 38, 41, 77]
    controller = build_controller(small_config("clients=10", "sample_fraction=0.3", "selection=uniform"))
    assert [[w.client_id for w in controller.plan(r)] for r in (1, 2, 3)] == [[2, 3, 6], [4, 6, 9], [0, 6, 9]]
    default = StaticController(10, 3, batch_size=8, epochs=1, local_steps=None, seed=0)
    assert [w.client_id for w in default.plan(2)] == [4, 6, 9]


def test_power_of_choice_keeps_the_highest_losses_of_its_candidates() -> None:
    choice = PowerOfChoice(SelectionConfig(name="power_of_choice", candidates=6))
    choice.observe(1, [update(c, loss) for c, loss in enumerate(LOSSES)])
    # every client a candidate: the two highest losses, 2.4 (client 3) and 1.5 (client 1)
    assert choice.select(2, numpy_rng(0, "sample", 2), 6, 2) == [1, 3]
    # d = 3: numpy draws clients 1, 4, 3 for this seed; of them 3 (2.4) and 1 (1.5)
    three = PowerOfChoice(SelectionConfig(name="power_of_choice", candidates=3))
    three.observe(1, [update(c, loss) for c, loss in enumerate(LOSSES)])
    assert three.select(1, numpy_rng(0, "sample", 1), 6, 2) == [1, 3]
    assert three.select(1, numpy_rng(0, "sample", 1), 6, 1) == [3]
    # a client never heard from is explored before any known loss
    fresh = PowerOfChoice(SelectionConfig(name="power_of_choice", candidates=6))
    fresh.observe(1, [update(c, loss) for c, loss in enumerate(LOSSES) if c != 4])
    assert fresh.select(2, numpy_rng(0, "sample", 2), 6, 2) == [3, 4]
    # an absent client is never a candidate: then 1.5 (client 1) and 1.1 (client 5)
    assert choice.select(2, numpy_rng(0, "sample", 2), 6, 2, absent={3}) == [1, 5]


def test_oort_utility_by_hand() -> None:
    # |B| loss = 50 x 0.8 = 40; uncertainty sqrt(0.1 ln 5 / 2) = 0.28368; 4 s against T = 2 s: x (2/4)^2
    assert oort_utility(40.0, 2, 5, 4.0, 2.0, 2.0) == pytest.approx((40 + 0.2836758) * 0.25, rel=1e-6)
    assert oort_utility(40.0, 2, 5, 1.0, 2.0, 2.0) == pytest.approx(40.2836758, rel=1e-6)  # fast: no penalty
    assert percentile([5, 1, 1, 1, 1, 1], 30) == 1 and percentile([3, 1, 2], 100) == 3


def oort(**settings: float) -> Oort:
    return Oort(SelectionConfig(name="oort", **settings))


def test_oort_exploits_the_highest_utility_and_penalizes_the_slow() -> None:
    """Round 1 explored everyone: 100 examples each, losses LOSSES, client 5 five times slower. In
    round 2 T is the 30th percentile of [1, 1, 1, 1, 1, 5] = 1 s; utilities 100 x loss + sqrt(0.1 ln 2 / 1)
    = 20.26, 150.26, 90.26, 240.26, 10.26, and client 5's 110.26 x (1/5)^2 = 4.41. The cut-off is 0.95 x
    150.26 = 142.75: clients 3 and 1 alone reach it."""
    s = oort(exploration=0.0, min_exploration=0.0)
    s.observe(1, [update(c, loss, compute=5.0 if c == 5 else 1.0) for c, loss in enumerate(LOSSES)])
    u = s.utilities(2, range(6))
    bonus = math.sqrt(0.1 * math.log(2))
    assert u[5] == pytest.approx((110 + bonus) / 25) and u[3] == pytest.approx(240 + bonus)
    assert s.select(2, numpy_rng(0, "sample", 2), 6, 2) == [1, 3]
    assert s.select(2, numpy_rng(0, "sample", 2), 6, 3) == [1, 2, 3]  # cut-off 0.95 x 90.26: 3, 1, 2
    # without the penalty client 5 (110.26) outranks client 2 (90.26)
    fast = oort(exploration=0.0, min_exploration=0.0, penalty=0.0)
    fast.observe(1, [update(c, loss, compute=5.0 if c == 5 else 1.0) for c, loss in enumerate(LOSSES)])
    assert fast.select(2, numpy_rng(0, "sample", 2), 6, 3) == [1, 3, 5]


def test_oort_explores_a_decaying_share_of_unseen_clients() -> None:
    s = oort(exploration=0.5, exploration_decay=0.5, min_exploration=0.25)
    s.observe(1, [update(c, loss) for c, loss in enumerate(LOSSES)])  # clients 0-5 explored, 6-11 not
    chosen = s.select(2, numpy_rng(0, "sample", 2), 12, 4)
    # 2 exploring slots (0.5 x 4) to unseen clients, 2 exploiting: 3 and 1 (the cut-off admits no third)
    assert [c for c in chosen if c < 6] == [1, 3] and len([c for c in chosen if c >= 6]) == 2
    assert s.exploration == 0.25  # 0.5 x 0.5, not below the minimum
    chosen = s.select(3, numpy_rng(0, "sample", 3), 12, 4)
    assert len([c for c in chosen if c >= 6]) == 1  # 0.25 x 4
    nobody = oort()
    assert len(nobody.select(1, numpy_rng(0, "sample", 1), 12, 4, absent={0, 1})) == 4  # all exploring


def test_oort_pacer_relaxes_the_preferred_duration_when_utility_falls() -> None:
    s = oort(pacer_window=2, pacer_step=10.0, exploration=0.0, min_exploration=0.0)
    for rnd, loss in enumerate([2.0, 2.0, 1.0, 0.5], 1):
        s.select(rnd, numpy_rng(0, "sample", rnd), 2, 2)
        s.observe(rnd, [update(0, loss), update(1, loss)])
    # exploited utility per round: none in round 1 (both explored), then 2 x 100 x loss: 400, 200, 100;
    # the window of rounds 1-2 (400) beats that of rounds 3-4 (300): T's percentile rises 30 -> 40
    assert s.history == [0.0, 400.0, 200.0, 100.0]
    assert s.percentile == 40.0


def test_the_config_selects_and_checks_a_selection(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert small_config("selection=oort").selection.name == "oort"
    with pytest.raises(ConfigError, match="'selection.name': unknown selection 'oorrt'"):
        small_config("selection.name=oorrt")
    with pytest.raises(ConfigError, match="selection.exploration"):
        small_config("selection.exploration=1.5")
    with pytest.raises(ConfigError, match="'selection.name'.*asynchronous"):
        small_config("selection=oort", "asynchronous.enabled=true", "heterogeneity.clock=virtual")
    (tmp_path / "mine.py").write_text(
        "class Lowest:\n"
        "    def __init__(self, settings):\n        self.offset = settings.options['offset']\n"
        "    def select(self, rnd, rng, num_clients, count, absent=()):\n"
        "        return list(range(self.offset, self.offset + count))\n"
        "    def observe(self, rnd, updates):\n        pass\n"
        "class NotOne:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = small_config("selection.name=mine:Lowest", "selection.options={offset: 1}", "sample_fraction=0.5")
    assert [w.client_id for w in build_controller(config).plan(1)] == [1, 2]
    with pytest.raises(ConfigError, match="no selection class.*select, observe"):
        small_config("selection.name=mine:NotOne")


@pytest.mark.parametrize("name", ["power_of_choice", "oort"])
def test_a_resumed_run_selects_as_the_uninterrupted_one(tmp_path: Path, name: str) -> None:
    """On the virtual clock, where a client's compute time (Oort's duration) is a function of its work."""
    overrides = (f"selection={name}", "sample_fraction=0.5", "rounds=4", "task.partition={scheme: dirichlet, alpha: 0.3}",
                 "heterogeneity.clock=virtual", "heterogeneity.speeds=[1, 4, 2, 8]")
    whole, records = run_to_end(tmp_path / "whole", *overrides)
    resumed, resumed_records = run_interrupted(tmp_path / "resumed", 2, *overrides)
    assert_same_params(whole, resumed)
    assert comparable(records) == comparable(resumed_records)
    uniform = run_to_end(tmp_path / "uniform", *overrides[1:])[1]
    assert [[c["id"] for c in r["clients"]] for r in records] != [[c["id"] for c in r["clients"]] for r in uniform]
