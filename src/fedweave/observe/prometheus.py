"""A live Prometheus endpoint of a federated server (``observe.prometheus_port``; extra
``prometheus``): where the run stands, for a dashboard or an alert.

Served by the process that runs the rounds (``fedweave server``, the server process of
the process launcher, ``fedweave run``) from the start of the run to its end, at
``http://HOST:PORT/metrics``. Every value comes from the round's record, as written to
``metrics.jsonl``, except the node counts, read from the gRPC transport at each scrape:

=====================================  ===============================================
``fedweave_round``                     the last round finished
``fedweave_rounds_planned``            rounds the run is to take
``fedweave_clients_registered``        nodes that registered with the gRPC server
``fedweave_clients_alive``             of those, nodes heard from within heartbeat_timeout
``fedweave_updates_accepted_total``    updates that counted in a round that was not skipped
``fedweave_updates_rejected_total``    by ``reason``: the validation's reasons (the
                                       record's ``rejected``: ``names``, ``shape``,
                                       ``dtype``, ``non_finite`` ...), ``no_answer`` (lost, late, failed), ``round_skipped``
                                       (answers of a round skipped for too few of them)
``fedweave_bytes_sent_total``          bytes the server sent (``bytes_sent``)
``fedweave_bytes_received_total``      bytes it received (``bytes_received``)
``fedweave_round_seconds``             the last round's wall time
``fedweave_test_accuracy``             the last test accuracy
=====================================  ===============================================
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from fedweave import validation
from fedweave.errors import ConfigError

log = logging.getLogger(__name__)

REASONS = (*validation.REASONS, "no_answer", "round_skipped")


@runtime_checkable
class NodeCounter(Protocol):
    """A transport that can tell how many nodes registered and how many are alive."""

    def node_counts(self) -> tuple[int, int]: ...


def updates(record: Mapping[str, Any]) -> tuple[int, dict[str, int]]:
    """Accepted updates of a round's record and the others by reason: the validation's
    reasons (the record's ``rejected``), ``no_answer`` and ``round_skipped``."""
    sampled = record.get("clients_sampled") or 0
    completed = record.get("clients_completed") or 0
    rejected = {reason: int(n) for reason, n in (record.get("rejected") or {}).items()}
    skipped = bool(record.get("skipped"))
    reasons = {
        **rejected,
        "no_answer": max(sampled - completed - sum(rejected.values()), 0),
        "round_skipped": completed if skipped else 0,
    }
    return (0 if skipped else completed), reasons


class PrometheusLogger:
    """Serves the metrics above on ``port`` (all interfaces) until :meth:`close`."""

    def __init__(self, port: int, planned: int, nodes: NodeCounter | None = None):
        try:
            import prometheus_client as pc
            from prometheus_client.core import GaugeMetricFamily
        except ImportError as exc:
            raise ConfigError(
                "config key 'observe.prometheus_port': needs prometheus-client; install it with "
                "pip install 'fedweave[prometheus]'"
            ) from exc
        self.registry = pc.CollectorRegistry()
        r = self.registry
        self.round = pc.Gauge("fedweave_round", "the last round finished", registry=r)
        pc.Gauge("fedweave_rounds_planned", "rounds the run is to take", registry=r).set(planned)
        self.accepted = pc.Counter("fedweave_updates_accepted", "updates that counted in a round", registry=r)
        self.rejected = pc.Counter("fedweave_updates_rejected", "updates that did not count, by reason",
                                   ["reason"], registry=r)
        for reason in REASONS:
            self.rejected.labels(reason)
        self.sent = pc.Counter("fedweave_bytes_sent", "bytes the server sent", registry=r)
        self.received = pc.Counter("fedweave_bytes_received", "bytes the server received", registry=r)
        self.round_time = pc.Gauge("fedweave_round_seconds", "the last round's wall time", registry=r)
        self.accuracy = pc.Gauge("fedweave_test_accuracy", "the last test accuracy", registry=r)
        if nodes is not None:

            class Nodes:
                def collect(self) -> Any:
                    registered, alive = nodes.node_counts()
                    yield GaugeMetricFamily("fedweave_clients_registered", "nodes that registered", value=registered)
                    yield GaugeMetricFamily("fedweave_clients_alive", "registered nodes heard from lately",
                                            value=alive)

            r.register(Nodes())
        try:
            self.server, self.thread = pc.start_http_server(port, registry=r)
        except OSError as exc:
            raise ConfigError(f"config key 'observe.prometheus_port': cannot serve on port {port}: {exc}") from exc
        log.info("Prometheus metrics on http://0.0.0.0:%d/metrics", port)

    def record(self, step: int, record: Mapping[str, Any]) -> None:
        self.round.set(step)
        accepted, rejected = updates(record)
        self.accepted.inc(accepted)
        for reason, count in rejected.items():
            self.rejected.labels(reason).inc(count)
        self.sent.inc(record.get("bytes_sent") or 0)
        self.received.inc(record.get("bytes_received") or 0)
        self.round_time.set(record.get("wall_time") or 0.0)
        if record.get("test_accuracy") is not None:
            self.accuracy.set(record["test_accuracy"])

    def close(self, run_dir: Path, finished: bool) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)
