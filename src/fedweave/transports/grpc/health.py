"""The standard gRPC health-checking service (``grpc.health.v1.Health``) of a fedweave server.

The federation's own port serves it (behind the same TLS as the federation), and with
``grpc.health_listen`` set, a second, plaintext port serves it alone: a Kubernetes ``grpc``
probe cannot present a client certificate, so under ``tls: mtls`` the kubelet asks there.
That port answers nothing but SERVING / NOT_SERVING, for the whole server (service
``""``) and for ``fedweave.v1.Federation``.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fedweave.errors import ConfigError, TransportError
from fedweave.transports.grpc import protocol as p

log = logging.getLogger(__name__)

SERVICES = ("", p.SERVICE)


def _health_modules() -> tuple[Any, Any, Any]:
    try:
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    except ImportError:
        raise ConfigError("the gRPC health service needs grpcio-health-checking: pip install 'fedweave[grpc]'") from None
    return health, health_pb2, health_pb2_grpc


class Health:
    """The health servicer of one gRPC server, and the optional plaintext port that serves only it."""

    def __init__(self, grpc: Any, server: Any, listen: str | None):
        health, self._pb2, pb2_grpc = _health_modules()
        self._servicer = health.HealthServicer()
        self._set("NOT_SERVING")
        pb2_grpc.add_HealthServicer_to_server(self._servicer, server)
        self._probe_server = None
        self.address: str | None = None
        if listen is not None:
            probe = grpc.server(ThreadPoolExecutor(max_workers=2, thread_name_prefix="fedweave-health"))
            pb2_grpc.add_HealthServicer_to_server(self._servicer, probe)
            try:
                port = probe.add_insecure_port(listen)
            except RuntimeError as exc:
                raise TransportError(f"cannot listen on {listen} (grpc.health_listen): {exc}") from None
            probe.start()
            self._probe_server = probe
            self.address = f"{listen.rpartition(':')[0]}:{port}"
            log.info("gRPC health service (plaintext, health only) on %s", self.address)

    def _set(self, status: str) -> None:
        value = self._pb2.HealthCheckResponse.ServingStatus.Value(status)
        for service in SERVICES:
            self._servicer.set(service, value)

    def serving(self) -> None:
        """The server is up: probes answer SERVING."""
        self._set("SERVING")

    def close(self) -> None:
        """Probes answer NOT_SERVING, then the plaintext port stops."""
        self._set("NOT_SERVING")
        if self._probe_server is not None:
            self._probe_server.stop(grace=0.5).wait(timeout=2.0)


def check(address: str, service: str = "", timeout: float = 2.0) -> str:
    """Ask the plaintext health service at ``address``; return the status name (e.g. ``SERVING``)."""
    grpc = p.grpc_module()
    _, pb2, pb2_grpc = _health_modules()
    with grpc.insecure_channel(address) as channel:
        reply = pb2_grpc.HealthStub(channel).Check(pb2.HealthCheckRequest(service=service), timeout=timeout)
    return str(pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
