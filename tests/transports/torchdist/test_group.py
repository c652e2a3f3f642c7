"""Bucketing of a site group's collectives."""

from __future__ import annotations

from fedweave.transports.torchdist.group import plan_buckets


def test_plan_buckets() -> None:
    assert plan_buckets([4, 4, 4, 4], 8) == [(0, 2), (2, 4)]
    assert plan_buckets([10, 1, 1], 8) == [(0, 1), (1, 3)]
    assert plan_buckets([], 8) == []
