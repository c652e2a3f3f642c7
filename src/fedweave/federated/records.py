"""A round's record: the keys every round writes, its traffic, its training metrics, and
:func:`finish_record`, which finishes the record of a synchronous round
(:func:`fedweave.federated.rounds.run`) and of a buffered server step
(:mod:`fedweave.federated.buffered`) alike.

A spine fills in what its round did (the clients sampled and completed, its bytes, the updates
rejected by reason and the claims capped, the clients' timings, the strategy's training metrics);
:func:`finish_record` then adds, in this order, every key of :data:`RECORD_KEYS` the round left
unset (None), the plugins' metrics, the strategy's own (``strategy_<key>``), the evaluation's, the
evaluation's traffic counted in the round's bytes, and the round's ``wall_time``.
"""

from __future__ import annotations

import math
import time
from typing import Any, cast

from fedweave.conforms import Conforms
from fedweave.plugins.chain import Chains
from fedweave.plugins.contracts import ReportsMetrics
from fedweave.strategies.base import Strategy, training_metrics
from fedweave.types import Update

_reports_metrics = Conforms(ReportsMetrics)

Record = dict[str, Any]

RECORD_KEYS = (
    "round",
    "wall_time",
    "train_loss",
    "test_accuracy",
    "test_loss",
    "clients_sampled",
    "clients_completed",
    "bytes_sent",
    "bytes_received",
    "skipped",
    "round_time",
    "clients",
    "rejected",
    "capped",
)
"""Keys every round's record has (None where a round has no value, e.g. no evaluation)."""


def finish_record(record: Record, chains: Chains, strategy: Strategy, evaluated: Record, started: float) -> Record:
    """A round's ``record`` finished (module doc): ``evaluated`` is the round's evaluation
    (:func:`~fedweave.federated.rounds.evaluate_round`), ``started`` the ``time.perf_counter()``
    its wall time counts from."""
    finished = {**dict.fromkeys(RECORD_KEYS), **record, **chains.metrics(), **strategy_metrics(strategy), **evaluated}
    add_evaluation_traffic(finished)
    finished["wall_time"] = time.perf_counter() - started
    return finished


def strategy_metrics(strategy: Strategy) -> Record:
    """The strategy's own numbers of the round (its optional ``metrics()``), as ``strategy_<key>``."""
    if not _reports_metrics(strategy):
        return {}
    return {f"strategy_{key}": float(value) for key, value in cast(ReportsMetrics, strategy).metrics().items()}


TRAFFIC = ("bytes_sent", "bytes_received", "wire_bytes_sent", "wire_bytes_received")
"""An exchange's byte counts: payload everywhere, wire where a network carried it (docs/metrics.md)."""


def add_evaluation_traffic(record: Record) -> None:
    """The traffic of a federated evaluation (``eval_*`` keys) counted in the round's bytes."""
    counts = {key: (record.get(key) or 0) + record.pop(f"eval_{key}", 0) for key in TRAFFIC}
    record.update(traffic_counts(counts))


def traffic_counts(counts: dict[str, int]) -> Record:
    """A record's byte counts: the payload's, and the wire's where anything crossed a network."""
    return {k: v for k, v in counts.items() if k.startswith("bytes") or counts["wire_bytes_sent"]
            or counts["wire_bytes_received"]}


def train_metrics(strategy: Strategy, updates: list[Update]) -> Record:
    """Each training metric the strategy's clients send (``train_loss`` and those it declares), weighted by examples."""
    return {name: weighted_metric(updates, name) for name in sorted(training_metrics(strategy.Client))}


def weighted_metric(updates: list[Update], name: str) -> float | None:
    pairs = [(u.metrics[name], u.num_examples) for u in updates if name in u.metrics]
    pairs = [(v, n) for v, n in pairs if math.isfinite(v)]
    if not pairs:
        return None
    return sum(v * n for v, n in pairs) / sum(n for _, n in pairs)
