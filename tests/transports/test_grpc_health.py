"""The gRPC health service of the server: SERVING while it serves, NOT_SERVING when it closes,
on the plaintext probe port (``grpc.health_listen``) even when the federation needs mutual TLS,
and on the federation's own port behind its TLS."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fedweave import config as config_mod
from fedweave.transports.grpc.certs import make_credentials
from fedweave.errors import ConfigError
from fedweave.transports.grpc import protocol as p
from fedweave.transports.grpc.health import Health, check
from fedweave.transports.grpc.server import GrpcServerTransport


def test_probe_port_answers_serving_under_mtls_then_not_serving_on_close(tmp_path: Path) -> None:
    creds = make_credentials(tmp_path / "creds", 1)
    s = config_mod.load(
        None,
        [
            "clients=1", "transport=grpc", "grpc.tls=mtls", "grpc.tokens=true", f"grpc.credentials={creds}",
            "grpc.health_listen=127.0.0.1:0", "grpc.poll_timeout=0.2",
        ],
    ).grpc
    server = GrpcServerTransport(s, 1, listen="127.0.0.1:0")
    try:
        probe = server.health.address
        assert probe is not None and probe != server.address
        assert check(probe) == "SERVING"
        assert check(probe, p.SERVICE) == "SERVING"
        with pytest.raises(grpc.RpcError) as err:  # only the services the server names
            check(probe, "some.other.Service")
        assert err.value.code() is grpc.StatusCode.NOT_FOUND
        # The federation's port speaks mTLS: a plaintext probe gets no answer there.
        with pytest.raises(grpc.RpcError):
            check(server.address, timeout=0.5)
    finally:
        server.close()
    with pytest.raises(grpc.RpcError):  # the probe port is gone
        check(probe, timeout=0.5)


def test_not_serving_before_the_server_is_up_and_after_it_closes() -> None:
    host = grpc.server(ThreadPoolExecutor(max_workers=2))
    port = host.add_insecure_port("127.0.0.1:0")
    health = Health(grpc, host, None)
    host.start()
    try:
        assert check(f"127.0.0.1:{port}") == "NOT_SERVING"
        health.serving()
        assert check(f"127.0.0.1:{port}") == "SERVING"
        health.close()
        assert check(f"127.0.0.1:{port}") == "NOT_SERVING"
    finally:
        host.stop(grace=None).wait(timeout=5)


def test_the_federation_port_serves_health_behind_its_tls(tmp_path: Path) -> None:
    creds = make_credentials(tmp_path / "creds", 1)
    s = config_mod.load(None, ["clients=1", "transport=grpc", "grpc.tls=tls", f"grpc.credentials={creds}"]).grpc
    server = GrpcServerTransport(s, 1, listen="127.0.0.1:0")
    try:
        assert server.health.address is None
        port = server.address.rpartition(":")[2]
        tls = grpc.ssl_channel_credentials((creds / "ca.pem").read_bytes())
        with grpc.secure_channel(f"localhost:{port}", tls) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.close()


def test_health_listen_must_be_host_port() -> None:
    with pytest.raises(ConfigError, match="grpc.health_listen"):
        config_mod.load(None, ["transport=grpc", "grpc.health_listen=8081"])
