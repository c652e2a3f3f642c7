"""Aggregation rules: how the clients' tensors are combined into one.

``mean`` is the example-weighted average every averaging strategy starts from.
"""

from __future__ import annotations

from fedweave.config import AggregationConfig
from fedweave.strategies.aggregate import weighted_average
from fedweave.strategies.base import Average


def averager(config: AggregationConfig) -> Average:
    """The combine function named by ``config.rule``."""
    if config.rule == "mean":
        return weighted_average
    raise ValueError(f"unknown aggregation rule {config.rule!r}")
