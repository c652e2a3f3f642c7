"""The adaptive federated controller on a virtual clock (no training, no sleeps)."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch

from fedweave import config as config_mod
from fedweave.federated.adaptive import MISS_PENALTY, AdaptiveController, client_timings
from fedweave.federated.controller import StaticController
from fedweave.config import ClientControllerConfig
from fedweave.errors import ConfigError
from fedweave.types import Update, UpdateKind, Work

SAMPLE_TIME = 1e-3  # virtual seconds per training sample at speed 1


def controller(
    n: int = 8, per_round: int | None = None, steps: int | None = 40, batch: int = 16, **settings: object
) -> AdaptiveController:
    configured = StaticController(n, per_round or n, batch_size=batch, epochs=1, local_steps=steps, seed=0)
    return AdaptiveController(configured, ClientControllerConfig(kind="adaptive", **settings))


def virtual_time(work: Work, speed: float, examples: int) -> tuple[int, float]:
    """(steps, compute time) of ``work`` by a client of ``speed`` holding ``examples`` samples."""
    batch = min(work.batch_size, examples)
    steps = work.local_steps if work.local_steps is not None else work.epochs * math.ceil(examples / batch)
    return steps, steps * batch * SAMPLE_TIME / speed


def run_round(
    ctl: AdaptiveController,
    rnd: int,
    speeds: dict[int, float],
    examples: int = 100,
    noise: float = 0.0,
    rng: np.random.Generator | None = None,
    drop: set[int] = frozenset(),  # type: ignore[assignment]
) -> tuple[list[Work], dict[int, float]]:
    """One round on the virtual clock: the plan and each answering client's compute time."""
    plan = ctl.plan(rnd)
    updates, times = [], {}
    for w in plan:
        steps, t = virtual_time(w, speeds[w.client_id], examples)
        if noise:
            t *= float(np.exp(noise * rng.standard_normal()))  # type: ignore[union-attr]
        if w.client_id in drop:
            continue
        times[w.client_id] = t
        updates.append(Update(UpdateKind.DELTA, {}, examples, client_id=w.client_id, local_steps=steps, compute_time=t))
    ctl.observe(rnd, updates)
    return plan, times


SPEEDS = {i: float(i + 1) for i in range(8)}  # 1..8


@pytest.mark.parametrize("adjust", ["steps", "batch_size"])
def test_speeds_1_to_8_finish_together_near_the_target_after_two_rounds(adjust: str) -> None:
    ctl = controller(adjust=adjust, batch=64)
    _, first = run_round(ctl, 1, SPEEDS, examples=1000)
    assert max(first.values()) / min(first.values()) == pytest.approx(8.0)  # configured work: 8x apart
    assert ctl.target == pytest.approx(float(np.median(list(first.values()))))
    for rnd in (2, 3):
        plan, times = run_round(ctl, rnd, SPEEDS, examples=1000)
        assert all(abs(t / ctl.target - 1) <= 0.06 for t in times.values()), (plan, times)
    sizes = [w.local_steps if adjust == "steps" else w.batch_size for w in plan]
    assert sizes == sorted(sizes) and sizes[-1] / sizes[0] == pytest.approx(8.0, rel=0.15)  # work follows speed


def test_a_configured_target_is_met_from_the_second_round() -> None:
    ctl = controller(target_round_time=0.5)
    run_round(ctl, 1, SPEEDS)
    assert ctl.target == 0.5
    _, times = run_round(ctl, 2, SPEEDS)
    assert max(times.values()) == pytest.approx(0.5, rel=0.03) and min(times.values()) == pytest.approx(0.5, rel=0.06)


def test_noisy_times_are_smoothed() -> None:
    rng = np.random.default_rng(0)
    ctl = controller(ewma=0.3, target_round_time=0.5)
    spreads = []
    for rnd in range(1, 16):
        _, times = run_round(ctl, rnd, SPEEDS, noise=0.1, rng=rng)
        spreads.append(max(times.values()) / 0.5)
    assert np.mean(spreads[5:]) < 1.25  # the slowest of 8 lognormal(0.1) draws alone is ~1.16x
    assert max(spreads[5:]) < 1.45


def test_a_speed_change_is_followed_at_once() -> None:
    ctl = controller(target_round_time=0.5)
    speeds = dict(SPEEDS)
    for rnd in (1, 2):
        run_round(ctl, rnd, speeds)
    speeds[7] = 1.0  # the fastest client becomes the slowest
    run_round(ctl, 3, speeds)
    _, times = run_round(ctl, 4, speeds)
    assert times[7] == pytest.approx(0.5, rel=0.06)


def test_unknown_clients_get_the_median_or_the_configured_work() -> None:
    ctl = controller(per_round=4)
    first = ctl.plan(1)
    assert [(w.batch_size, w.local_steps) for w in first] == [(16, 40)] * 4  # nothing measured yet
    ctl.pending = []
    run_round(ctl, 1, SPEEDS)
    measured = set(ctl.cost)
    assert len(measured) == 4
    unknown = next(c for c in range(8) if c not in measured)
    median = float(np.median(list(ctl.cost.values())))
    assert ctl.estimate(unknown) == median
    assert ctl.work(unknown).local_steps == round(ctl.target / (median * 16))
    known = next(iter(measured))
    assert ctl.work(known).local_steps == round(ctl.target / (ctl.cost[known] * 16))


def test_a_client_that_does_not_answer_gets_less_work() -> None:
    ctl = controller(target_round_time=0.5)
    run_round(ctl, 1, SPEEDS)
    plan, _ = run_round(ctl, 2, SPEEDS, drop={0})
    before = plan[0].local_steps
    plan, _ = run_round(ctl, 3, SPEEDS)
    assert plan[0].local_steps == round(before / MISS_PENALTY)


def test_bounds_hold() -> None:
    ctl = controller(target_round_time=0.1, min_steps=8, max_steps=30)
    run_round(ctl, 1, SPEEDS)
    steps = [w.local_steps for w in ctl.plan(2)]
    assert min(steps) == 8 and max(steps) == 30
    ctl = controller(target_round_time=0.1, adjust="batch_size", steps=10, min_batch=20, max_batch=64)
    run_round(ctl, 1, SPEEDS, examples=50)
    batches = [w.batch_size for w in ctl.plan(2)]
    assert min(batches) == 20 and max(batches) == 50  # never above a client's own examples


def test_state_round_trip_gives_the_same_plans() -> None:
    ctl = controller(per_round=5)
    for rnd in (1, 2):
        run_round(ctl, rnd, SPEEDS, drop={3})
    buffer = io.BytesIO()
    torch.save(ctl.state_dict(), buffer)
    buffer.seek(0)
    restored = controller(per_round=5)
    restored.load_state_dict(torch.load(buffer, weights_only=False))
    assert restored.state_dict() == ctl.state_dict()
    for rnd in (3, 4):
        assert run_round(restored, rnd, SPEEDS) == run_round(ctl, rnd, SPEEDS)


def test_client_timings_show_work_compute_and_idle() -> None:
    plan = [Work(0, 16, local_steps=5), Work(1, 32, local_steps=5), Work(2, 16, local_steps=5)]
    updates = [
        Update(UpdateKind.DELTA, {}, 100, client_id=1, local_steps=5, compute_time=2.0),
        Update(UpdateKind.DELTA, {}, 10, client_id=0, local_steps=5, compute_time=0.5),
    ]
    timings = client_timings(plan, updates, None)
    assert timings == {
        "round_time": 2.0,
        "clients": [
            {"id": 0, "steps": 5, "batch": 10, "compute": 0.5, "idle": 1.5},
            {"id": 1, "steps": 5, "batch": 32, "compute": 2.0, "idle": 0.0},
        ],
    }
    assert client_timings(plan, updates, 3.0)["round_time"] == 3.0  # client 2 was waited for until the deadline
    assert client_timings(plan, updates, 2.5)["round_time"] == 2.5  # or given up after 2.5 s (lost)
    assert client_timings(plan, updates, 1.0)["round_time"] == 2.0  # not below the slowest compute


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["controller.kind=adaptive", "controller.adjust=batch_size"], "batch_size needs local.steps"),
        (["controller.max_steps=2", "controller.min_steps=3"], "'controller.max_steps': 2 is below min_steps=3"),
        (["controller.kind=adaptive", "controller.target_round_time=5", "round_timeout=4"], "no margin"),
        (["controller.kind=adaptve"], "did you mean 'adaptive'"),
        (["mode=data_parallel", "controller=adaptive"], "'controller.kind': applies to mode federated"),
    ],
)
def test_config_errors_name_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config_mod.load(None, overrides)
