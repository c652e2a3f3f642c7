"""A live Prometheus endpoint of a federated server (``observe.prometheus_port``; extra
``prometheus``): where the run stands, for a dashboard or an alert.

Served by the process that runs the rounds (``fedweave server``, the server process of
the process launcher, ``fedweave run``) from the start of the run to its end, at
``http://HOST:PORT/metrics`` and no other path (404), where HOST is the one the gRPC server
listens on (127.0.0.1 without gRPC): an endpoint is never more exposed than the server. At most
:data:`WORKERS` scrapes are served at once, each connection given :data:`READ_TIMEOUT` seconds to
send its request; a connection past :data:`WAITING` more is closed at once, so half-open
connections hold no more than that many threads. Every value comes from the round's record, as written to
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

import http.server
import logging
import socket
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol, runtime_checkable
from urllib.parse import urlsplit

from fedweave.federated import checks
from fedweave.errors import ConfigError

log = logging.getLogger(__name__)

REASONS = (*checks.REASONS, "no_answer", "round_skipped")
PATH = "/metrics"
WORKERS = 4
"""Scrapes served at once."""
WAITING = 8
"""Connections accepted beyond those served, waiting for a worker; one more is closed at once."""
READ_TIMEOUT = 3.0
"""Seconds a connection has to send its request (and take the answer) before it is closed."""


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


class _Scrape(http.server.BaseHTTPRequestHandler):
    """One connection: ``GET /metrics`` answered with the registry's text format, any other path 404."""

    server: _Endpoint
    timeout = READ_TIMEOUT

    def do_GET(self) -> None:  # noqa: N802 - the name http.server calls
        if urlsplit(self.path).path != PATH:
            self.send_error(404, f"only {PATH} is served here")
            return
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        body = generate_latest(self.server.registry)
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_LATEST)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
        log.debug("%s: %s", self.address_string(), format % args)


class _Endpoint(http.server.HTTPServer):
    """An HTTP server whose connections a fixed pool of :data:`WORKERS` threads serves."""

    request_queue_size = 64  # connections the system queues before the accept (no thread each)

    def __init__(self, host: str, port: int, registry: Any):
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.registry = registry
        self._pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="fedweave-metrics")
        self._slots = threading.BoundedSemaphore(WORKERS + WAITING)
        super().__init__((host, port), _Scrape)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):  # all busy, the queue full: not queued
            self.shutdown_request(request)
            return
        self._pool.submit(self._serve, request, client_address)

    def _serve(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:  # noqa: BLE001 - a broken connection ends that connection only
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # socketserver calls this from inside its except clause: the exception is the current one
        log.debug("metrics connection from %s failed", client_address, exc_info=True)  # noqa: LOG014

    def server_close(self) -> None:
        super().server_close()
        self._pool.shutdown(wait=False, cancel_futures=True)


class PrometheusLogger:
    """Serves the metrics above on ``host:port`` until :meth:`close`."""

    def __init__(self, port: int, planned: int, nodes: NodeCounter | None = None, host: str = "127.0.0.1"):
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
            counter: NodeCounter = nodes

            class Nodes:
                def collect(self) -> Any:
                    registered, alive = counter.node_counts()
                    yield GaugeMetricFamily("fedweave_clients_registered", "nodes that registered", value=registered)
                    yield GaugeMetricFamily("fedweave_clients_alive", "registered nodes heard from lately",
                                            value=alive)

            r.register(Nodes())
        try:
            self.server = _Endpoint(host, port, r)
        except OSError as exc:
            raise ConfigError(
                f"config key 'observe.prometheus_port': cannot serve on {host} port {port}: {exc}"
            ) from exc
        self.thread = threading.Thread(target=self.server.serve_forever, name="fedweave-metrics", daemon=True)
        self.thread.start()
        where = f"[{host}]" if ":" in host else host
        log.info("Prometheus metrics on http://%s:%d%s", where, port, PATH)

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
