"""Buffered asynchronous aggregation (FedBuff) on the virtual clock: the math by hand,
the order of arrivals, the reduction to FedAvg, exact resume."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import pytest
import torch

from fedweave import config as config_mod
from fedweave import runner
from fedweave.federated.buffered import buffered_step, staleness_weight
from fedweave.config import AsynchronousConfig
from fedweave.errors import ConfigError
from fedweave.strategies.base import StrategyContext
from fedweave.strategies.fedavg import FedAvg, FedAvgHParams
from fedweave.types import Update, UpdateKind
from fedweave.federated.checks import ExampleLimits

from conftest import assert_same_params, run_interrupted, run_to_end, small_config

ASYNC = ["heterogeneity.clock=virtual", "asynchronous.enabled=true", "local.steps=10"]
SPEEDS = "heterogeneity.speeds=[1, 2, 4, 8]"  # 10 steps x 16 samples x 1 ms / speed: 0.16, 0.08, 0.04, 0.02 s


def test_staleness_weights() -> None:
    default = AsynchronousConfig(enabled=True)
    assert [staleness_weight(t, default) for t in (0, 3, 8)] == [1.0, 0.5, pytest.approx(1 / 3)]
    assert staleness_weight(1, AsynchronousConfig(exponent=1.0)) == 0.5
    assert staleness_weight(50, AsynchronousConfig(staleness="constant")) == 1.0
    hinge = AsynchronousConfig(staleness="hinge", hinge_a=10.0, hinge_b=4)
    assert [staleness_weight(t, hinge) for t in (0, 4, 5, 6)] == [1.0, 1.0, 1 / 11, 1 / 21]


def test_buffered_step_by_hand() -> None:
    strategy = FedAvg(FedAvgHParams(), StrategyContext(num_clients=2))
    params = {"w": torch.tensor([1.0, 2.0], dtype=torch.float64), "count": torch.tensor(3)}
    fresh = Update(UpdateKind.DELTA, {"w": torch.tensor([2.0, 0.0], dtype=torch.float64), "count": torch.tensor(5)}, 1)
    stale = Update(UpdateKind.DELTA, {"w": torch.tensor([0.0, 4.0], dtype=torch.float64), "count": torch.tensor(7)}, 3)
    settings = AsynchronousConfig(enabled=True, server_lr=0.5)
    out = buffered_step(strategy, 1, params, [fresh, stale], [0, 3], settings)
    # s(3) = 1/2: the stale delta counts as [0, 2]; mean weighted by examples (1, 3): [0.5, 1.5]; half a step
    torch.testing.assert_close(out["w"], torch.tensor([1.25, 2.75], dtype=torch.float64), rtol=0, atol=1e-15)
    assert out["count"].item() == 7  # counters are never scaled: they take the largest value
    plain = buffered_step(strategy, 1, params, [fresh, stale], [0, 0], AsynchronousConfig(enabled=True))
    assert_same_params(plain, strategy.aggregate(1, params, [fresh, stale]))  # fresh, η = 1: FedAvg itself


def test_arrivals_follow_the_speeds_deterministically(tmp_path: Path) -> None:
    overrides = [*ASYNC, SPEEDS, "asynchronous.buffer_size=1", "rounds=4"]
    _, records = run_to_end(tmp_path / "a", *overrides)
    # t=0: all four start on version 0. 0.02: client 3 arrives (step 1), restarts on v1.
    # 0.04: client 2 (dispatched first) then client 3 arrive, steps 2 and 3; 0.06: client 3 again.
    steps = [(r["clock"], [(c["id"], c["staleness"]) for c in r["clients"]]) for r in records]
    assert steps == [
        (pytest.approx(0.02), [(3, 0)]),
        (pytest.approx(0.04), [(2, 1)]),
        (pytest.approx(0.04), [(3, 1)]),
        (pytest.approx(0.06), [(3, 0)]),
    ]
    assert [r["round_time"] for r in records] == pytest.approx([0.02, 0.02, 0.0, 0.02])
    _, again = run_to_end(tmp_path / "b", *overrides)
    assert [{k: v for k, v in r.items() if k not in ("wall_time", "elapsed")} for r in again] == [
        {k: v for k, v in r.items() if k not in ("wall_time", "elapsed")} for r in records
    ]


def test_fresh_updates_and_a_buffer_of_every_client_is_fedavg(tmp_path: Path) -> None:
    sync, sync_records = run_to_end(tmp_path / "sync", "local.steps=10")
    buffered, records = run_to_end(
        tmp_path / "async", *ASYNC, "asynchronous.buffer_size=4", "asynchronous.concurrency=4"
    )
    assert_same_params(sync, buffered)
    for key in ("train_loss", "test_accuracy", "test_loss", "bytes_sent", "bytes_received", "clients_completed"):
        assert [r[key] for r in records] == [r[key] for r in sync_records], key
    assert all(c["staleness"] == 0 for r in records for c in r["clients"])


def test_resume_is_exact(tmp_path: Path) -> None:
    overrides = [*ASYNC, SPEEDS, "controller=adaptive", "asynchronous.buffer_size=2", "rounds=6", "round_timeout=0.15"]
    whole, whole_records = run_to_end(tmp_path / "whole", *overrides)
    resumed, resumed_records = run_interrupted(tmp_path / "resumed", 3, *overrides)
    assert_same_params(whole, resumed)
    untimed = [{k: v for k, v in r.items() if k not in ("wall_time", "elapsed")} for r in whole_records]
    assert [{k: v for k, v in r.items() if k not in ("wall_time", "elapsed")} for r in resumed_records] == untimed
    assert (tmp_path / "resumed" / "clients.png").is_file()


def test_the_adaptive_controller_evens_out_update_rates(tmp_path: Path) -> None:
    common = [*ASYNC, SPEEDS, "asynchronous.buffer_size=2", "rounds=16", "eval.every=0"]
    counts = {}
    for kind in ("static", "adaptive"):
        _, records = run_to_end(tmp_path / kind, *common, f"controller={kind}")
        counts[kind] = Counter(c["id"] for r in records[4:] for c in r["clients"])
    assert counts["static"][3] >= 4 * counts["static"][0]  # the fastest client dominates the buffer
    assert max(counts["adaptive"].values()) <= 2 * min(counts["adaptive"].values())


def test_stragglers_and_stale_updates_are_dropped(tmp_path: Path) -> None:
    _, records = run_to_end(tmp_path / "deadline", *ASYNC, SPEEDS, "asynchronous.buffer_size=2", "round_timeout=0.1")
    assert all(c["id"] != 0 for r in records for c in r["clients"])  # 0.16 s of work never makes 0.1 s
    _, records = run_to_end(
        tmp_path / "fresh", *ASYNC, SPEEDS, "asynchronous.buffer_size=2", "asynchronous.max_staleness=0"
    )
    assert all(c["staleness"] == 0 for r in records for c in r["clients"])
    assert any(r["clients_sampled"] > r["clients_completed"] for r in records)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["asynchronous.enabled=true"], "set heterogeneity.clock: virtual"),
        ([*ASYNC, "asynchronous.buffer_size=11"], "'asynchronous.buffer_size': 11 updates"),
        ([*ASYNC, "asynchronous.concurrency=11"], "'asynchronous.concurrency': 11 is more than clients=10"),
        ([*ASYNC, "plugins.client_send=[secagg]"], "works per synchronous round"),
        ([*ASYNC, "asynchronous.enabled=true", "transport=grpc"], "virtual is a simulation.s clock"),
    ],
)
def test_config_errors_name_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config_mod.load(None, overrides)


def test_bad_updates_are_rejected_and_counted_in_the_next_step(tmp_path: Path) -> None:
    """Client 3's noise overflows float32: every update it sends is infinite, and rejected."""
    attack = ["attacks.kind=noise", "attacks.clients=[3]", "attacks.std=1e39"]
    params, records = run_to_end(tmp_path, *ASYNC, SPEEDS, "asynchronous.buffer_size=2", "rounds=4", *attack)
    assert all(c["id"] != 3 for r in records for c in r["clients"])
    assert sum(r["rejected"].get("non_finite", 0) for r in records) >= 2
    assert all(bool(torch.isfinite(v).all()) for v in params.values() if v.is_floating_point())


def test_a_buffer_of_one_is_bounded_by_the_other_clients_latest_claims(tmp_path: Path) -> None:
    """K = 1: a lone buffered claim is its own median, so the cohort is the buffer with every other
    client's latest counted claim. Client 2, knowing no size on the server's side, claims 10^6: once
    the others have been counted it is capped at 3 x their 64 examples each, and the book survives
    a checkpoint."""
    config = small_config(*ASYNC, SPEEDS, "rounds=12", "asynchronous.buffer_size=1",
                          "attacks.kind=inflate_examples", "attacks.clients=[2]")
    r = runner.prepare(config, tmp_path / "run")
    r.parts.checks = dataclasses.replace(r.parts.checks, limits=ExampleLimits())  # as deployed: no sizes
    records = runner.run_rounds(r)
    seen: set[int] = set()
    for record in records:
        (cid,) = [c["id"] for c in record["clients"]]
        assert record["capped"] == (cid == 2 and bool(seen - {2})), record
        seen.add(cid)
    assert r.buffered is not None and r.buffered.claims == {0: 64.0, 1: 64.0, 2: 192.0, 3: 64.0}
    state = r.buffered.state_dict()
    again = runner.prepare(config, tmp_path / "other").buffered
    assert again is not None
    again.load_state_dict(state)
    assert again.claims == r.buffered.claims
