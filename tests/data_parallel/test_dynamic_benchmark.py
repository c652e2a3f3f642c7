"""benchmarks/dynamic_batching.py's comparison: interleaved pairs, each pair's speed-up, the spread,
and a speed-up above the ideal flagged invalid (issue 26 item 11: it ran each policy once, one after
the other, and printed 2.76x where 2.33x is the most any machine can give)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import load_script

PATH = Path(__file__).parents[2] / "benchmarks" / "dynamic_batching.py"


@pytest.fixture(scope="module")
def bench():  # type: ignore[no-untyped-def]
    return load_script(PATH)


def test_the_ideal_is_the_sum_of_speeds_over_n_times_the_slowest(bench) -> None:  # type: ignore[no-untyped-def]
    assert bench.ideal_speedup((1, 2, 4)) == pytest.approx(7 / 3)
    assert bench.ideal_speedup((2, 2)) == 1.0
    assert bench.ideal_speedup((1, 3)) == 2.0


def test_the_policies_run_interleaved_and_the_order_alternates(bench) -> None:  # type: ignore[no-untyped-def]
    assert bench.interleaved(3) == [(0, "dynamic"), (0, "static"), (1, "static"), (1, "dynamic"),
                                    (2, "dynamic"), (2, "static")]


def test_each_pair_gives_a_speed_up_and_those_above_the_ideal_are_invalid(bench) -> None:  # type: ignore[no-untyped-def]
    spread = bench.speedups([10.0, 12.0, 11.0], [5.0, 4.0, 5.5], ideal=7 / 3)
    assert spread["ratios"] == [2.0, 3.0, 2.0]
    assert (spread["median"], spread["low"], spread["high"]) == (2.0, 2.0, 3.0)
    assert spread["invalid"] == [1]
