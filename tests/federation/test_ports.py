"""``job_ports``: each job's server takes the first port of the range that no running job holds and nothing
on the host is bound to; with none free the job waits in the queue instead of failing."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from fedweave.federation.config import load_federation
from fedweave.federation.ports import free_port

HOST = "127.0.0.1"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "federation"


@contextmanager
def held(port: int) -> Iterator[socket.socket]:
    """``port`` bound and listening on 127.0.0.1 by this test (another program's port, to the service)."""
    with socket.socket() as sock:
        sock.bind((HOST, port))
        sock.listen()
        yield sock


def bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def two_ports() -> range:
    """Two adjacent ports both free now (chosen at run time: another copy of the suite may run)."""
    for _ in range(50):
        with socket.socket() as sock:
            sock.bind((HOST, 0))
            port = sock.getsockname()[1]
        if port < 65535 and bindable(port) and bindable(port + 1):
            return range(port, port + 2)
    pytest.skip("no two adjacent free ports on 127.0.0.1")


def test_a_port_bound_by_another_program_is_skipped_and_a_jobs_port_is_never_shared() -> None:
    ports = two_ports()
    low, high = ports
    assert free_port(ports, HOST, taken=()) == low
    with held(low):
        assert free_port(ports, HOST, taken=()) == high
        assert free_port(ports, HOST, taken={high}) is None  # one busy, the other a running job's
    assert free_port(ports, HOST, taken={high}) == low
    assert free_port(ports, HOST, taken={low, high}) is None


def test_a_job_waits_queued_while_no_port_is_free_and_a_resumed_one_takes_a_free_port_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("grpc")
    from fedweave.federation.service import FederationServer
    from fedweave.transports.grpc.certs import make_credentials

    ports = two_ports()
    make_credentials(tmp_path / "certs", 0, site_names=["alpha"], admins=["ada"])
    fed = yaml.safe_load((EXAMPLES / "FED.yaml").read_text()) | {
        "address": f"{HOST}:0", "sites": ["alpha"], "job_ports": f"{ports[0]}-{ports[1]}"}
    (tmp_path / "FED.yaml").write_text(yaml.safe_dump(fed))
    server = FederationServer(load_federation(tmp_path / "FED.yaml"))
    launched: list[tuple[str, str]] = []
    monkeypatch.setattr(server, "_launch", lambda job, listen: launched.append((job, listen)))
    try:
        job = yaml.safe_load((EXAMPLES / "JOB.yaml").read_text()) | {"min_clients": 1}
        server._ports["job-other"] = ports[1]  # a running job's
        first = server.store.submit(job, None, None, "ada")["id"]
        server.tick()  # offered
        server.store.set_site(first, "alpha", state="accepted")
        with held(ports[0]), caplog.at_level(logging.INFO, logger="fedweave.federation.service"):
            server.tick()
            server.tick()
        assert server.store.get(first)["state"] == "queued" and not launched
        assert server.store.get(first)["sites"]["alpha"]["state"] == "accepted"  # its answer kept
        assert sum("waits: no port of job_ports" in r.getMessage() for r in caplog.records) == 1
        server.tick()  # the port another program held is free again
        assert launched == [(first, f"{HOST}:{ports[0]}")] and server.store.get(first)["state"] == "running"
        assert server._ports[first] == ports[0]
        server.store.update(first, address=f"{HOST}:{ports[0]}")
    finally:
        server.close()
    # the service started again (after kill -9): the running job's old address is gone, and its server
    # takes a free port of the range again
    again = FederationServer(load_federation(tmp_path / "FED.yaml"))
    relaunched: list[tuple[str, str]] = []
    monkeypatch.setattr(again, "_launch", lambda job, listen: relaunched.append((job, listen)))
    try:
        assert again.store.get(first)["address"] is None
        with held(ports[0]):
            again.tick()
        assert relaunched == [(first, f"{HOST}:{ports[1]}")]
        again._end(first, "cancelled", "test")
        assert first not in again._ports
    finally:
        again.close()
