"""Emulated heterogeneity: speed factors, schedules, thread limits, padding by sleep."""

from __future__ import annotations

import time

import pytest

from fedweave.emulation import Emulator, worker_threads
from fedweave.config import Crash, HeterogeneityConfig, SpeedChange


def test_speeds_1_2_4_give_slowdown_factors_4_2_1() -> None:
    config = HeterogeneityConfig(speeds=[1, 2, 4])
    assert [Emulator(config, w).factor(0) for w in range(3)] == [4.0, 2.0, 1.0]
    slower = HeterogeneityConfig(speeds=[1, 2, 4], slowdown=1.5)
    assert [Emulator(slower, w).factor(0) for w in range(3)] == [6.0, 3.0, 1.5]
    assert not Emulator(HeterogeneityConfig(), 0).active
    assert Emulator(HeterogeneityConfig(), 0).factor(5) == 1.0


def test_schedule_changes_a_speed_from_its_step_on() -> None:
    config = HeterogeneityConfig(
        speeds=[1, 2, 4],
        schedule=[SpeedChange(step=10, worker=2, speed=1), SpeedChange(step=20, worker=2, speed=4)],
    )
    e = Emulator(config, 2)
    assert [e.factor(s) for s in (9, 10, 19, 20)] == [1.0, 4.0, 4.0, 1.0]
    assert Emulator(config, 0).factor(15) == 4.0  # others unaffected
    faster = HeterogeneityConfig(speeds=[1, 2], schedule=[SpeedChange(step=0, worker=0, speed=8)])
    assert Emulator(faster, 0).factor(0) == 1.0  # cannot run faster than native


def test_pad_sleeps_until_the_compute_phase_lasts_factor_times_its_cpu_time() -> None:
    e = Emulator(HeterogeneityConfig(speeds=[1, 4]), 0)  # factor 4
    start = time.perf_counter()
    slept = e.pad(0, 10, cpu_seconds=0.02, wall_seconds=0.03)
    assert slept == pytest.approx(0.05)
    assert time.perf_counter() - start >= 0.05
    assert e.pad(0, 20, cpu_seconds=0.01, wall_seconds=0.05) == 0.0  # already slower than emulated
    two_threads = Emulator(HeterogeneityConfig(speeds=[1, 4]), 0, threads=2)
    assert two_threads.pad(0, 10, cpu_seconds=0.02, wall_seconds=0.0) == pytest.approx(0.04)
    assert Emulator(HeterogeneityConfig(), 0).pad(0, 10, 1.0, 0.0) == 0.0


def test_a_hiccup_of_the_host_is_not_multiplied_into_the_emulated_time() -> None:
    e = Emulator(HeterogeneityConfig(speeds=[1, 4]), 0)
    for cpu in (0.010, 0.011, 0.009):
        e.native_cost(32, cpu)
    assert e.native_cost(32, 0.050) == pytest.approx(0.0105)  # the median of its size, not 0.05
    # a second size: the line through both sizes' medians (fixed cost 2 ms, 0.265 ms a sample)
    assert e.native_cost(64, 0.019) == pytest.approx(0.019)
    assert e.native_cost(48, 0.5) == pytest.approx((0.0105 + 0.019) / 2)  # a spike at a third size is outvoted


def test_thread_limits_and_crash_steps() -> None:
    config = HeterogeneityConfig(threads=[1, 2], crashes=[Crash(step=7, worker=1)])
    assert worker_threads(config, 1, default=1) == 2
    assert worker_threads(HeterogeneityConfig(), 1, default=3) == 3
    assert worker_threads(config, 2, default=3) == 3  # a worker joined by hand, beyond the list
    assert Emulator(config, 1).crash_steps == {7}
    Emulator(config, 0).maybe_crash(7)  # not this worker: nothing happens
