"""Config sections of where a run's parts live and how they talk: topology, transports, launchers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from fedweave.errors import ConfigError
from fedweave.schema import opt


@dataclass
class TopologyConfig:
    """Who aggregates for whom and each link's transport; see docs/deployment.md (Topologies)."""

    SHORTHAND = "kind"
    kind: Literal["star", "hierarchical", "ring"] = opt(
        "star",
        help="who aggregates for whom: star (every client answers the server) | hierarchical (site leaders "
        "aggregate their members) | ring (decentralized gossip with neighbour averaging, no server step)",
    )
    sites: int | list[Any] | None = opt(
        None,
        help="hierarchical: N (client ids split into N contiguous sites) or nested lists of client ids, "
        "one list per site at any depth, e.g. [[0, 1], [2, 3]] or [[[0, 1], [2]], [[3, 4]]]",
    )
    inner: Literal["inmemory", "torchdist"] = opt(
        "inmemory", help="hierarchical: transport between a site leader and its members (torchdist: see torchdist.*)"
    )
    outer: Literal["inmemory", "grpc"] | None = opt(
        None, help="hierarchical: transport between site leaders and the server (none: transport.kind)"
    )
    pre_aggregate: Literal["auto", "never"] = opt(
        "auto",
        help="auto: a site leader sends its members' weighted average when that is exact (strategy with a "
        "weighted-sum server step, aggregation.rule mean, updates in the clear), else relays each update | "
        "never: always relay",
    )
    gossip_steps: int = opt(1, ge=1, help="ring: mixing steps with the neighbours after each round of local training")

    def validate(self, prefix: str) -> None:
        if self.kind != "hierarchical":
            if self.sites is not None:
                raise ConfigError(f"config key '{prefix}.sites': only kind 'hierarchical' has sites (kind is {self.kind!r})")
            return
        if self.sites is None:
            raise ConfigError(f"config key '{prefix}.sites': kind 'hierarchical' needs sites: N or lists of client ids")
        if isinstance(self.sites, int) and self.sites < 1:
            raise ConfigError(f"config key '{prefix}.sites': must be >= 1, got {self.sites}")


@dataclass
class TransportConfig:
    SHORTHAND = "kind"
    kind: Literal["inmemory", "grpc"] = opt(
        "inmemory", help="how messages travel: inmemory (simulation) | grpc (separate processes, see grpc.*)"
    )


@dataclass
class TorchDistConfig:
    """The torch.distributed transport (``topology.inner: torchdist``): gloo or NCCL collectives inside a site."""

    backend: Literal["auto", "gloo", "nccl"] = opt(
        "auto", help="auto: nccl when every rank has a CUDA device, else gloo"
    )
    address: str | None = opt(None, help="rendezvous host (none: $MASTER_ADDR, else 127.0.0.1)")
    port: int | None = opt(None, ge=0, le=65535, help="rendezvous port (none: $MASTER_PORT, else 29500)")
    timeout: float = opt(60.0, gt=0, help="seconds a collective or the rendezvous may take before it fails")
    idle_timeout: float = opt(3600.0, gt=0, help="seconds a site member waits for the next round before it fails")
    bucket_mb: float = opt(25.0, gt=0, help="largest flat buffer of one collective, in MiB")


@dataclass
class LauncherConfig:
    SHORTHAND = "kind"
    kind: Literal["local", "process", "ray"] = opt(
        "local",
        help="where nodes run: local = this process only (simulation, or the gRPC server) | "
        "process = the server and every client as local processes (needs transport grpc) | "
        "ray = the server here, clients trained by a pool of Ray actors (see ray.*)",
    )


@dataclass
class RayConfig:
    """The Ray launcher (``launcher: ray``, extra ``ray``); see docs/deployment.md (Ray)."""

    address: str | None = opt(
        None, help="Ray cluster to join: host:port of its head, or auto (none: start a local one in this process)"
    )
    actors: int | None = opt(
        None, ge=1, help="actors in the pool that trains the clients (none: as many as the cluster's resources hold)"
    )
    num_cpus: float = opt(1.0, gt=0, help="CPUs each actor reserves")
    num_gpus: float = opt(0.0, ge=0, help="GPUs each actor reserves (a fraction shares one GPU)")
    start_timeout: float = opt(300.0, gt=0, help="seconds the actors may take to start (each loads the task once)")


@dataclass
class GrpcConfig:
    """The gRPC transport (``transport: grpc``); see docs/deployment.md."""

    address: str = opt("127.0.0.1:50051", help="host:port clients connect to (launcher process picks a free port)")
    listen: str | None = opt(None, help="host:port the server binds (none: address), e.g. 0.0.0.0:50051")
    health_listen: str | None = opt(
        None, help="host:port of a plaintext port serving only the gRPC health service (for probes), e.g. 0.0.0.0:8081"
    )
    tls: Literal["none", "tls", "mtls"] = opt(
        "none", help="none | tls (clients verify the server) | mtls (and the server verifies each client)"
    )
    credentials: str | None = opt(
        None,
        help="folder written by `fedweave certs` (ca.pem, server.*, client-<id>.*, tokens); "
        "auto: launcher process writes fresh ones for each run",
    )
    tokens: bool = opt(False, help="require each client's secret token (credentials/tokens.json on the server)")
    allow_unauthenticated: bool = opt(
        False, help="acknowledge a server without tokens or mTLS (trusted network): no warning at its start"
    )
    chunk_bytes: int = opt(1 << 20, ge=4096, le=64 << 20, help="bytes per streamed chunk of a message")
    max_message_mb: float = opt(
        2048.0, gt=0, help="largest message a node accepts, in MiB (raise it for a model over ~500M float32 values; "
        "plugin he sends ~57 bytes a value: over ~37M values, checked when the server starts)"
    )
    checksum: bool = opt(True, help="CRC-32 on every chunk; a corrupted chunk is rejected")
    heartbeat_interval: float = opt(1.0, gt=0, help="seconds between a client's heartbeats (sent while it trains)")
    heartbeat_timeout: float = opt(10.0, gt=0, help="seconds without any sign of a client before it counts as lost")
    poll_timeout: float = opt(5.0, gt=0, help="seconds a client's request for work waits on the server")
    rpc_timeout: float = opt(10.0, gt=0, help="deadline of each short call (register, heartbeat)")
    stream_timeout: float = opt(3600.0, gt=0, help="deadline of one message transfer")
    connect_timeout: float = opt(60.0, gt=0, help="seconds a client keeps retrying an unreachable server")
    join_timeout: float = opt(
        60.0, ge=0, help="seconds the server waits for every client to register before round 1, and before a round "
        "for min_clients of them to be present"
    )
    backoff_initial: float = opt(0.1, gt=0, help="first retry delay in seconds; it doubles per retry")
    backoff_max: float = opt(5.0, gt=0, help="longest retry delay in seconds")
    job_deadline_factor: float | None = opt(
        4.0, gt=1, help="a job's deadline: this multiple of the job_deadline_quantile of the times the latest "
        "answered jobs took, at least job_deadline_min, never above round_timeout (none: round_timeout alone)",
    )
    job_deadline_quantile: float = opt(0.95, gt=0, le=1, help="the quantile of observed job times the deadline multiplies")
    job_deadline_min: float = opt(5.0, gt=0, help="seconds a job's deadline is at least")
    missed_deadline_backoff: int = opt(
        8, ge=0, help="most rounds a client that keeps missing its deadline is left out of sampling (after m misses in "
        "a row: 2^(m-1) to 2^m - 1 rounds, seeded; 0: never left out)",
    )
    push_grace: float = opt(10.0, gt=0, help="seconds a reply's upload may take before its rate is checked")
    push_min_rate: float = opt(
        65536.0, gt=0, help="bytes per second a reply's upload must average after push_grace; a slower one "
        "(a stalled or trickling stream) is cut off and its job failed",
    )

    def validate(self, prefix: str) -> None:
        if self.heartbeat_timeout <= 2 * self.heartbeat_interval:
            raise ConfigError(
                f"config key '{prefix}.heartbeat_timeout': {self.heartbeat_timeout} must exceed twice "
                f"heartbeat_interval ({self.heartbeat_interval}), or one late heartbeat loses a client"
            )
        if self.backoff_max < self.backoff_initial:
            raise ConfigError(f"config key '{prefix}.backoff_max': must be >= backoff_initial ({self.backoff_initial})")
        for key in ("address", "listen", "health_listen"):
            value = getattr(self, key)
            if value is not None:
                parse_address(value, f"config key '{prefix}.{key}'")
        if (self.tls != "none" or self.tokens) and self.credentials is None:
            what = f"tls {self.tls!r}" if self.tls != "none" else "tokens"
            raise ConfigError(
                f"config key '{prefix}.credentials': {what} needs the folder written by "
                "`fedweave certs --out DIR --clients N`"
            )


def parse_address(value: str, what: str) -> tuple[str, int]:
    """``host:port`` as its host and port; a ConfigError naming ``what`` unless the port is 0..65535."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not host.isprintable() or not (port.isascii() and port.isdigit()):
        raise ConfigError(f"{what}: expected host:port, got {value!r}")
    if int(port) > 65535:
        raise ConfigError(f"{what}: port {int(port)} is out of range 0..65535 (in {value!r})")
    return host, int(port)
