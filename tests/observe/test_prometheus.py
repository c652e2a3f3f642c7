"""Tests of fedweave.observe.prometheus: the endpoint of a gRPC server, scraped while the run
goes on, agrees with the run's metrics.jsonl at its end (and the server's TensorBoard events too)."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from conftest import free_port, small_config
from fedweave.nodes.client import run_client
from fedweave.nodes.server import serve
from fedweave.observe.prometheus import updates
from fedweave.federated.checks import REASONS

from .test_loggers import event_scalars


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the endpoint: (name, labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_updates_by_reason_from_a_record() -> None:
    assert updates({"clients_sampled": 5, "clients_completed": 3, "rejected": {"shape": 1}, "skipped": False}) == (
        3, {"shape": 1, "no_answer": 1, "round_skipped": 0})
    assert updates({"clients_sampled": 4, "clients_completed": 1, "skipped": True}) == (
        0, {"no_answer": 3, "round_skipped": 1})
    assert updates({"clients_sampled": 4, "clients_completed": 2, "rejected": {"non_finite": 1, "shape": 1}}) == (
        2, {"non_finite": 1, "shape": 1, "no_answer": 0, "round_skipped": 0})


def test_the_endpoint_of_a_grpc_server_agrees_with_its_metrics(tmp_path: Path) -> None:
    port, metrics_port = free_port(), free_port()
    config = small_config(
        "rounds=2", "clients=3", "transport=grpc", f"grpc.address=127.0.0.1:{port}", "grpc.join_timeout=1",
        "grpc.heartbeat_timeout=1", "grpc.heartbeat_interval=0.2", f"observe.prometheus_port={metrics_port}",
        "observe.tensorboard=true",
    )
    scraped: dict[int, Any] = {}

    def on_record(record: dict[str, Any]) -> None:  # runs after the endpoint saw the record
        scraped[record["round"]] = scrape(metrics_port)

    clients = [threading.Thread(target=run_client, args=(config, cid), daemon=True) for cid in (0, 1)]
    for t in clients:  # client 2 never comes: its job fails each round (no answer)
        t.start()
    serve(config, tmp_path / "run", on_record=on_record)
    for t in clients:
        t.join(20)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["clients_completed"] for r in records] == [2, 2]

    first, last = scraped[1], scraped[2]
    assert first[("fedweave_round", ())] == 1 and first[("fedweave_rounds_planned", ())] == 2
    assert (first[("fedweave_clients_registered", ())], first[("fedweave_clients_alive", ())]) == (2, 2)
    assert last[("fedweave_round", ())] == 2
    assert last[("fedweave_updates_accepted_total", ())] == sum(r["clients_completed"] for r in records) == 4
    # client 2 fails round 1; in round 2 it is sampled only if not yet known gone (absent)
    unanswered = sum(r["clients_sampled"] - r["clients_completed"] for r in records)
    assert last[("fedweave_updates_rejected_total", (("reason", "no_answer"),))] == unanswered >= 1
    assert all(last[("fedweave_updates_rejected_total", (("reason", reason),))] == 0 for reason in REASONS)
    assert last[("fedweave_bytes_sent_total", ())] == sum(r["bytes_sent"] for r in records)
    assert last[("fedweave_bytes_received_total", ())] == sum(r["bytes_received"] for r in records)
    assert last[("fedweave_round_seconds", ())] == pytest.approx(records[-1]["wall_time"])
    assert last[("fedweave_test_accuracy", ())] == pytest.approx(records[-1]["test_accuracy"])
    with pytest.raises(urllib.error.URLError):  # served while the run goes on, not after
        scrape(metrics_port)
    events = event_scalars(tmp_path / "run" / "tensorboard")  # the deployment's server logs as a local run does
    assert events["test_accuracy"] == [(r["round"], pytest.approx(r["test_accuracy"])) for r in records]


class Counts:
    """A gRPC server transport as the endpoint sees it: where it listens, its node counts."""

    def __init__(self, address: str):
        self.address = address

    def node_counts(self) -> tuple[int, int]:
        return 3, 2


def test_the_endpoint_binds_the_grpc_host_serves_metrics_only_and_bounds_its_threads(tmp_path: Path) -> None:
    """Issue 26 item 9: it bound 0.0.0.0 when gRPC listened on 127.0.0.1, answered any path, and
    4,000 half-open connections made 4,018 threads."""
    import socket
    import types

    from fedweave.observe import prometheus
    from fedweave.observe.loggers import open_loggers

    port = free_port()
    config = small_config(f"observe.prometheus_port={port}")
    loggers = open_loggers(config, tmp_path, types.SimpleNamespace(transport=Counts("127.0.0.1:50051")))
    (endpoint,) = loggers.loggers
    assert isinstance(endpoint, prometheus.PrometheusLogger)
    try:
        assert endpoint.server.server_address[0] == "127.0.0.1"
        assert scrape(port)[("fedweave_clients_registered", ())] == 3
        for path in ("/", "/metrics/x", "/favicon.ico", "/../metrics"):
            with pytest.raises(urllib.error.HTTPError) as answer:
                urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5)
            assert answer.value.code == 404, path
        before = threading.active_count()
        flood = [socket.create_connection(("127.0.0.1", port)) for _ in range(60)]  # half-open: they send nothing
        try:
            flood[-1].settimeout(10)
            assert flood[-1].recv(1) == b""  # past the workers and those waiting: closed at once, not queued
            assert threading.active_count() - before <= prometheus.WORKERS
        finally:
            for sock in flood:
                sock.close()
        assert scrape(port)[("fedweave_rounds_planned", ())] == config.rounds  # free again once they left
    finally:
        loggers.close(tmp_path)
