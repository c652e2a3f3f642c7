"""The run configuration: schema, YAML loading, dotted overrides, validation.

Everything is checked when the config is loaded, so nothing fails an hour into a
run for a typo. Each problem is one :class:`~fedweave.errors.ConfigError` line that
names the key. ``fedweave run --print-config`` shows the resolved result.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import re
import typing
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml

from fedweave.errors import ConfigError
from fedweave.schema import opt, parse, to_dict, unknown_key


@dataclass
class PartitionConfig:
    SHORTHAND = "scheme"
    scheme: Literal["iid", "dirichlet", "shards", "quantity"] = opt(
        "iid", help="how training data is split across clients"
    )
    alpha: float = opt(0.5, gt=0, help="Dirichlet concentration (dirichlet, quantity): lower is more skewed")
    shards_per_client: int = opt(2, ge=1, help="label-sorted shards per client (shards)")
    min_samples: int = opt(2, ge=1, help="fewest training samples any client may get")


@dataclass
class TaskConfig:
    dataset: str = opt(
        "digits",
        help="digits | mnist5k | synthetic | torchvision:mnist | torchvision:cifar10 | package.module:function",
    )
    dataset_options: dict[str, Any] = opt(factory=dict, help="keyword arguments of the dataset")
    data_root: str | None = opt(None, help="local folder of torchvision datasets")
    model: str = opt("mlp", help="mlp | cnn | package.module:function")
    model_options: dict[str, Any] = opt(factory=dict, help="keyword arguments of the model")
    loss: Literal["cross_entropy", "nll"] = opt("cross_entropy", help="training loss")
    test_fraction: float = opt(0.2, gt=0, lt=1, help="share of the data held out as the global test set")
    local_test_fraction: float = opt(0.2, ge=0, lt=1, help="share of each client's data kept as its local test split")
    partition: PartitionConfig = opt(factory=PartitionConfig)


@dataclass
class LocalConfig:
    epochs: int = opt(1, ge=1, help="local passes over the client's data per round")
    steps: int | None = opt(None, ge=1, help="local steps per round; overrides epochs when set")
    batch_size: int = opt(32, ge=1, help="local mini-batch size")
    optimizer: Literal["sgd", "adam"] = opt("sgd", help="local optimiser")
    lr: float = opt(0.05, gt=0, help="local learning rate")
    momentum: float = opt(0.0, ge=0, lt=1, help="SGD momentum")
    weight_decay: float = opt(0.0, ge=0, help="L2 weight decay")


@dataclass
class StrategyConfig:
    """``name`` plus the hyper-parameters the named strategy declares in its ``Params``."""

    SHORTHAND = "name"
    name: str = opt("fedavg", help="fedavg | package.module:Class")
    params: Any = None


@dataclass
class AggregationConfig:
    """How the server combines the clients' tensors; the robust rules are in :mod:`fedweave.strategies.robust`."""

    SHORTHAND = "rule"
    rule: Literal["mean", "median", "trimmed_mean", "krum", "multi_krum"] = opt(
        "mean",
        help="how client tensors are combined: mean (weighted by examples) | median | trimmed_mean "
        "(both coordinate-wise, unweighted) | krum | multi_krum (Byzantine-robust selection)",
    )
    trim_fraction: float = opt(0.1, ge=0, lt=0.5, help="trimmed_mean: share of values dropped at each end")
    byzantine: int = opt(1, ge=0, help="krum, multi_krum: assumed Byzantine clients f (needs > 2f + 2 updates)")
    multi_krum_m: int | None = opt(None, ge=1, help="multi_krum: updates selected and averaged (none: n - f)")

    def validate(self, prefix: str) -> None:
        if self.multi_krum_m is not None and self.rule != "multi_krum":
            raise ConfigError(
                f"config key '{prefix}.multi_krum_m': only rule 'multi_krum' uses it, but the rule is {self.rule!r}"
            )


@dataclass
class PluginSpec:
    name: str
    params: Any = None


@dataclass
class PluginsConfig:
    server_send: list[PluginSpec] = opt(factory=list, help="encode the broadcast on the server")
    client_receive: list[PluginSpec] = opt(factory=list, help="filter instructions on the client")
    client_send: list[PluginSpec] = opt(factory=list, help="encode updates on the client")
    server_receive: list[PluginSpec] = opt(factory=list, help="filter updates on the server")


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
    kind: Literal["local", "process"] = opt(
        "local",
        help="where nodes run: local = this process only (simulation, or the gRPC server) | "
        "process = the server and every client as local processes (needs transport grpc)",
    )


@dataclass
class GrpcConfig:
    """The gRPC transport (``transport: grpc``); see docs/deployment.md."""

    address: str = opt("127.0.0.1:50051", help="host:port clients connect to (launcher process picks a free port)")
    listen: str | None = opt(None, help="host:port the server binds (none: address), e.g. 0.0.0.0:50051")
    tls: Literal["none", "tls", "mtls"] = opt(
        "none", help="none | tls (clients verify the server) | mtls (and the server verifies each client)"
    )
    credentials: str | None = opt(
        None, help="folder written by `fedweave certs` (ca.pem, server.*, client-<id>.*, tokens)"
    )
    tokens: bool = opt(False, help="require each client's secret token (credentials/tokens.json on the server)")
    chunk_bytes: int = opt(1 << 20, ge=4096, le=64 << 20, help="bytes per streamed chunk of a message")
    max_message_mb: float = opt(65536.0, gt=0, help="largest message a node accepts, in MiB")
    checksum: bool = opt(True, help="CRC-32 on every chunk; a corrupted chunk is rejected")
    heartbeat_interval: float = opt(1.0, gt=0, help="seconds between a client's heartbeats (sent while it trains)")
    heartbeat_timeout: float = opt(10.0, gt=0, help="seconds without any sign of a client before it counts as lost")
    poll_timeout: float = opt(5.0, gt=0, help="seconds a client's request for work waits on the server")
    rpc_timeout: float = opt(10.0, gt=0, help="deadline of each short call (register, heartbeat)")
    stream_timeout: float = opt(3600.0, gt=0, help="deadline of one message transfer")
    connect_timeout: float = opt(60.0, gt=0, help="seconds a client keeps retrying an unreachable server")
    join_timeout: float = opt(60.0, ge=0, help="seconds the server waits for every client to register before round 1")
    backoff_initial: float = opt(0.1, gt=0, help="first retry delay in seconds; it doubles per retry")
    backoff_max: float = opt(5.0, gt=0, help="longest retry delay in seconds")

    def validate(self, prefix: str) -> None:
        if self.heartbeat_timeout <= 2 * self.heartbeat_interval:
            raise ConfigError(
                f"config key '{prefix}.heartbeat_timeout': {self.heartbeat_timeout} must exceed twice "
                f"heartbeat_interval ({self.heartbeat_interval}), or one late heartbeat loses a client"
            )
        if self.backoff_max < self.backoff_initial:
            raise ConfigError(f"config key '{prefix}.backoff_max': must be >= backoff_initial ({self.backoff_initial})")
        for key in ("address", "listen"):
            value = getattr(self, key)
            host, sep, port = (value or "h:0").rpartition(":")
            if not sep or not host or not port.isdigit() or int(port) > 65535:
                raise ConfigError(f"config key '{prefix}.{key}': expected host:port, got {value!r}")
        if (self.tls != "none" or self.tokens) and self.credentials is None:
            what = f"tls {self.tls!r}" if self.tls != "none" else "tokens"
            raise ConfigError(
                f"config key '{prefix}.credentials': {what} needs the folder written by "
                "`fedweave certs --out DIR --clients N`"
            )


@dataclass
class EvalConfig:
    every: int = opt(1, ge=0, help="evaluate the global model on the test set every N rounds (0: last round only)")
    federated_every: int = opt(0, ge=0, help="evaluate on clients' local test splits every N rounds (0: never)")
    federated_fraction: float = opt(1.0, gt=0, le=1, help="share of clients in a federated evaluation")
    batch_size: int = opt(1024, ge=1, help="evaluation batch size")


@dataclass
class CheckpointConfig:
    every: int = opt(1, ge=0, help="write the server state every N rounds (0: never)")


@dataclass
class BatchControllerConfig:
    """How the data-parallel controller splits the global batch (see :mod:`fedweave.batching.dynamic`)."""

    SHORTHAND = "policy"
    policy: Literal["dynamic", "static"] = opt(
        "dynamic", help="dynamic: batch sizes follow measured throughput | static: equal batches"
    )
    cadence: Literal["steps", "epoch"] = opt("steps", help="adjust every `every` measured steps, or once per epoch")
    every: int = opt(10, ge=1, help="measured steps between adjustments (cadence: steps)")
    warmup: int = opt(1, ge=0, help="steps left unmeasured after each change of the batch sizes")
    ewma: float = opt(0.3, gt=0, le=1, help="weight of the newest throughput sample in its moving average")
    dead_band: float = opt(0.05, ge=0, help="no change while max_i t_i / mean t < 1 + dead_band")
    min_batch: int = opt(1, ge=0, help="smallest per-worker batch")
    max_batch: int | None = opt(None, ge=1, help="largest per-worker batch (none: no limit)")
    memory_guard: bool = opt(False, help="cap a worker's batch when its throughput falls after an increase, or on OOM")
    guard_drop: float = opt(0.25, gt=0, lt=1, help="relative throughput fall after an increase that trips the guard")

    def validate(self, prefix: str) -> None:
        if self.max_batch is not None and self.max_batch < self.min_batch:
            raise ConfigError(
                f"config key '{prefix}.max_batch': {self.max_batch} is below min_batch={self.min_batch}"
            )


@dataclass
class StalenessOptions:
    """How asynchronous aggregation weighs an update computed on an older model: FedBuff
    (``asynchronous``) and the data-parallel parameter server (``data_parallel.sync: asp``)."""

    staleness: Literal["polynomial", "constant", "hinge"] = opt(
        "polynomial",
        help="weight s(t) of an update t server steps old: polynomial (1 + t)^-exponent | constant 1 | "
        "hinge 1 while t <= hinge_b, then 1 / (hinge_a (t - hinge_b) + 1)",
    )
    exponent: float = opt(0.5, ge=0, help="staleness polynomial: s(t) = (1 + t)^-exponent")
    hinge_a: float = opt(10.0, ge=0, help="staleness hinge: slope after hinge_b")
    hinge_b: int = opt(4, ge=0, help="staleness hinge: server steps an update may be old at full weight")
    max_staleness: int | None = opt(None, ge=0, help="updates older than this many server steps are dropped")


@dataclass
class DataParallelConfig(StalenessOptions):
    """Data-parallel SGD over torch.distributed (``mode: data_parallel``): synchronous steps
    (``sync: bsp``) or a parameter server (``sync: asp``, see :mod:`fedweave.parameter_server`)."""

    workers: int = opt(2, ge=1, help="worker processes started on this machine")
    global_batch: int = opt(64, ge=1, help="samples per step over all workers (B = sum of the b_i)")
    epochs: int = opt(1, ge=1, help="passes over the training set")
    steps: int | None = opt(None, ge=1, help="optimiser steps in all; overrides epochs when set")
    optimizer: Literal["sgd", "adam"] = opt("sgd", help="optimiser every worker applies to the summed gradient")
    lr: float = opt(0.05, gt=0, help="learning rate")
    momentum: float = opt(0.0, ge=0, lt=1, help="SGD momentum")
    weight_decay: float = opt(0.0, ge=0, help="L2 weight decay")
    backend: Literal["auto", "gloo", "nccl"] = opt("auto", help="auto: nccl when CUDA is present, else gloo")
    timeout: float = opt(30.0, gt=0, help="seconds a collective or a re-formation waits before a worker counts as lost")
    min_workers: int = opt(1, ge=1, help="fewest surviving workers that continue after a failure")
    log_every: int = opt(10, ge=1, help="steps per metrics line (and at each epoch's end)")
    sync: Literal["bsp", "asp"] = opt(
        "bsp",
        help="bsp: synchronous steps, every worker waits for the slowest | asp: a parameter server applies each "
        "worker's gradient as it arrives, nobody waits (see fedweave.parameter_server)",
    )
    buffer: int = opt(1, ge=1, help="asp: arriving gradients summed into one server step (K)")
    controller: BatchControllerConfig = opt(factory=BatchControllerConfig)


@dataclass
class SpeedChange:
    step: int = opt(ge=0, help="step from which the new speed applies")
    worker: int = opt(ge=0, help="worker index")
    speed: float = opt(gt=0, help="the worker's new relative speed")


@dataclass
class Crash:
    step: int = opt(ge=0, help="step at which the worker kills itself (before its all-reduce)")
    worker: int = opt(ge=0, help="worker index")


@dataclass
class Join:
    step: int = opt(ge=1, help="first step the new worker takes part in")
    worker: int = opt(ge=0, help="the new worker's index: data_parallel.workers for the first join, then + 1")


@dataclass
class HeterogeneityConfig:
    """Emulated unlike machines on one box (see :mod:`fedweave.batching.heterogeneity`)."""

    speeds: list[float] = opt(
        factory=list, help="relative speed per worker (federated: per client), e.g. [1, 2, 4] (empty: no emulation)"
    )
    slowdown: float = opt(1.0, ge=1, help="the fastest configured worker runs this many times slower than native")
    threads: list[int] = opt(factory=list, help="torch threads per worker (empty: the run's threads)")
    schedule: list[SpeedChange] = opt(factory=list, help="speed changes during training: [{step, worker, speed}]")
    crashes: list[Crash] = opt(factory=list, help="emulated crashes: [{step, worker}] (the worker is SIGKILLed)")
    joins: list[Join] = opt(
        factory=list, help="emulated joins: [{step, worker}] (a new worker joins the running job at that step)"
    )
    speed_range: list[float] = opt(
        factory=list,
        help="federated: [low, high], each client's speed drawn uniformly from it, seeded (not with speeds)",
    )
    clock: Literal["real", "virtual"] = opt(
        "real",
        help="federated simulation: real = a client sleeps to last its speed factor x its measured compute time | "
        "virtual = no sleeps: a client's compute time is its samples x sample_time / speed (deterministic)",
    )
    sample_time: float = opt(1e-3, gt=0, help="clock virtual: seconds a client of speed 1 takes per training sample")


@dataclass
class ClientControllerConfig:
    """The federated controller: each sampled client's local work (see :mod:`fedweave.batching.federated`)."""

    SHORTHAND = "kind"
    kind: Literal["static", "adaptive"] = opt(
        "static",
        help="static: every client does the configured local work | adaptive: work from each client's measured "
        "speed, so that the round's clients finish together near target_round_time",
    )
    adjust: Literal["steps", "batch_size"] = opt(
        "steps",
        help="adaptive: a client's local steps follow its speed (batches of local.batch_size) | its batch size "
        "follows its speed (local.steps steps each)",
    )
    target_round_time: float | None = opt(
        None, gt=0, help="adaptive: seconds of local work per round (none: median compute time of the first round)"
    )
    ewma: float = opt(0.5, gt=0, le=1, help="adaptive: weight of the newest measurement of a client's time per sample")
    min_steps: int = opt(1, ge=1, help="adaptive, adjust steps: fewest local steps a client is given")
    max_steps: int | None = opt(None, ge=1, help="adaptive, adjust steps: most local steps (none: no limit)")
    min_batch: int = opt(1, ge=1, help="adaptive, adjust batch_size: smallest batch a client is given")
    max_batch: int | None = opt(None, ge=1, help="adaptive, adjust batch_size: largest batch (none: no limit)")

    def validate(self, prefix: str) -> None:
        for low, high in (("min_steps", "max_steps"), ("min_batch", "max_batch")):
            top = getattr(self, high)
            if top is not None and top < getattr(self, low):
                raise ConfigError(f"config key '{prefix}.{high}': {top} is below {low}={getattr(self, low)}")


@dataclass
class AsynchronousConfig(StalenessOptions):
    """Buffered asynchronous aggregation, FedBuff (see :mod:`fedweave.asynchronous`)."""

    enabled: bool = opt(
        False, help="server steps every buffer_size arriving updates, clients never wait (a round = one server step)"
    )
    buffer_size: int | None = opt(None, ge=1, help="K, updates per server step (none: the clients a round samples)")
    concurrency: int | None = opt(None, ge=1, help="clients training at once (none: every client)")
    server_lr: float = opt(1.0, gt=0, help="the server moves this share of the way to the buffer's aggregate")


@dataclass
class Config:
    name: str = opt("quickstart", help="run name; the run directory is <output_dir>/<name>-<timestamp>")
    seed: int = opt(0, ge=0, help="seed of every random choice")
    mode: Literal["federated", "data_parallel"] = opt(
        "federated", help="federated | data_parallel (synchronous SGD over torch.distributed, see data_parallel.*)"
    )
    rounds: int = opt(10, ge=1, help="federated rounds")
    clients: int = opt(10, ge=1, help="number of clients")
    sample_fraction: float = opt(1.0, gt=0, le=1, help="share of clients sampled each round")
    min_clients: int = opt(1, ge=1, help="fewest clients sampled per round, and fewest that must answer")
    round_timeout: float | None = opt(None, gt=0, help="seconds a round waits for clients (none: no limit)")
    threads: int = opt(1, ge=0, help="torch intra-op threads; 1 suits small models, 0 keeps torch's default")
    output_dir: str = opt("runs", help="where run directories are created")
    task: TaskConfig = opt(factory=TaskConfig)
    local: LocalConfig = opt(factory=LocalConfig)
    strategy: StrategyConfig = opt(factory=StrategyConfig)
    aggregation: AggregationConfig = opt(factory=AggregationConfig)
    plugins: PluginsConfig = opt(factory=PluginsConfig)
    topology: TopologyConfig = opt(factory=TopologyConfig)
    transport: TransportConfig = opt(factory=TransportConfig)
    launcher: LauncherConfig = opt(factory=LauncherConfig)
    grpc: GrpcConfig = opt(factory=GrpcConfig)
    torchdist: TorchDistConfig = opt(factory=TorchDistConfig)
    eval: EvalConfig = opt(factory=EvalConfig)
    checkpoint: CheckpointConfig = opt(factory=CheckpointConfig)
    data_parallel: DataParallelConfig = opt(factory=DataParallelConfig)
    heterogeneity: HeterogeneityConfig = opt(factory=HeterogeneityConfig)
    controller: ClientControllerConfig = opt(factory=ClientControllerConfig)
    asynchronous: AsynchronousConfig = opt(factory=AsynchronousConfig)

    @property
    def clients_per_round(self) -> int:
        """Clients sampled each round: the fraction rounded half up, at least min_clients."""
        return max(self.min_clients, int(self.sample_fraction * self.clients + 0.5))

    @property
    def data_parallel_workers(self) -> int:
        """Workers of a data-parallel run: ``data_parallel.workers``, then the joining ones
        (``heterogeneity.joins``), which take the indices after them."""
        return self.data_parallel.workers + len(self.heterogeneity.joins)

    def validate(self, prefix: str) -> None:
        if self.min_clients > self.clients:
            raise ConfigError(
                f"config key 'min_clients': {self.min_clients} is more than clients={self.clients}; "
                "a round cannot sample more clients than exist"
            )
        if self.eval.federated_every and self.task.local_test_fraction == 0:
            raise ConfigError(
                "config key 'eval.federated_every': federated evaluation needs clients' local test "
                "splits, but task.local_test_fraction is 0; set it above 0 or eval.federated_every to 0"
            )
        if self.mode == "federated" and self.launcher.kind == "process" and self.transport.kind != "grpc":
            raise ConfigError(
                f"config key 'launcher': 'process' runs every node as its own process, which needs a "
                f"network transport; set transport: grpc (got {self.transport.kind!r})"
            )
        if self.mode == "data_parallel":
            _check_data_parallel(self)
        if self.topology.kind == "hierarchical":
            _check_sites(self)
        if self.topology.kind == "ring" and self.transport.kind != "inmemory":
            raise ConfigError(
                "config key 'topology.kind': ring gossip runs in simulation (transport: inmemory); "
                f"got transport {self.transport.kind!r}"
            )
        if self.topology.kind == "hierarchical" and self.transport.kind == "grpc" and self.topology.inner != "torchdist":
            raise ConfigError(
                "config key 'topology.inner': a hierarchy deployed over gRPC reaches each site's members over "
                "torch.distributed; set topology.inner: torchdist (inmemory links exist only in simulation)"
            )
        if self.topology.outer is not None and self.topology.outer != self.transport.kind:
            raise ConfigError(
                f"config key 'topology.outer': {self.topology.outer!r} is the server's link, which is "
                f"transport: {self.transport.kind!r}; set transport: {self.topology.outer} (or leave outer unset)"
            )
        _check_heterogeneity_aware(self)


def _check_sites(config: Config) -> None:
    """Every client id in exactly one site; lists nest to any depth."""
    sites = config.topology.sites
    if isinstance(sites, int):
        if sites > config.clients:
            raise ConfigError(f"config key 'topology.sites': {sites} sites for {config.clients} clients")
        return
    seen: list[int] = []

    def walk(node: Any, key: str) -> None:
        if isinstance(node, bool) or not isinstance(node, (int, list)):
            raise ConfigError(f"config key '{key}': expected a client id or a list, got {node!r}")
        if isinstance(node, int):
            if not 0 <= node < config.clients:
                raise ConfigError(f"config key '{key}': {node} is not a client id (0..{config.clients - 1})")
            seen.append(node)
            return
        if not node:
            raise ConfigError(f"config key '{key}': a site needs at least one member")
        for i, child in enumerate(node):
            walk(child, f"{key}[{i}]")

    walk(sites, "topology.sites")
    if sorted(seen) != list(range(config.clients)):
        twice = sorted({c for c in seen if seen.count(c) > 1})
        missing = sorted(set(range(config.clients)) - set(seen))
        raise ConfigError(
            f"config key 'topology.sites': every client must be in exactly one site "
            f"(in several: {twice}, in none: {missing})"
        )


def emulates_clients(config: Config) -> bool:
    """Whether a federated run emulates unlike clients (``heterogeneity`` speeds, range, schedule, clock)."""
    het = config.heterogeneity
    return bool(het.speeds or het.speed_range or het.schedule) or het.slowdown != 1.0 or het.clock == "virtual"


def _check_heterogeneity_aware(config: Config) -> None:
    """Cross-key checks of the federated controller, client emulation and asynchronous aggregation."""
    het, ctl, asy = config.heterogeneity, config.controller, config.asynchronous
    if config.mode == "data_parallel":
        for key, used in (
            ("controller.kind", ctl.kind != "static"),
            ("asynchronous.enabled", asy.enabled),
            ("heterogeneity.speed_range", bool(het.speed_range)),
            ("heterogeneity.clock", het.clock != "real"),
        ):
            if used:
                raise ConfigError(
                    f"config key '{key}': applies to mode federated; data_parallel has data_parallel.controller"
                )
        return
    n = config.clients
    if het.speeds and len(het.speeds) != n:
        raise ConfigError(
            f"config key 'heterogeneity.speeds': {len(het.speeds)} values for clients={n}; give one per client or none"
        )
    if any(s <= 0 for s in het.speeds):
        raise ConfigError(f"config key 'heterogeneity.speeds': speeds must be > 0, got {het.speeds}")
    if het.speed_range:
        if het.speeds:
            raise ConfigError("config key 'heterogeneity.speed_range': give speeds or speed_range, not both")
        if len(het.speed_range) != 2 or not 0 < het.speed_range[0] <= het.speed_range[1]:
            raise ConfigError(
                "config key 'heterogeneity.speed_range': expected [low, high] with 0 < low <= high, "
                f"got {het.speed_range}"
            )
    for key in ("threads", "crashes", "joins"):
        if getattr(het, key):
            raise ConfigError(f"config key 'heterogeneity.{key}': applies to mode data_parallel only")
    for i, change in enumerate(het.schedule):
        if change.worker >= n:
            raise ConfigError(
                f"config key 'heterogeneity.schedule[{i}].worker': {change.worker} is not a client (0..{n - 1}); "
                "in federated mode worker is a client id and step a round"
            )
    if emulates_clients(config) and (config.transport.kind != "inmemory" or config.topology.kind != "star"):
        raise ConfigError(
            "config key 'heterogeneity': emulated client speeds need the in-process simulation (transport "
            "inmemory, topology star); clients on real machines need no emulation"
        )
    target = ctl.target_round_time
    timeout = config.round_timeout
    if ctl.kind == "adaptive" and target is not None and timeout is not None and target >= timeout:
        raise ConfigError(
            f"config key 'controller.target_round_time': {target} s leaves no margin before round_timeout "
            f"({config.round_timeout} s); set it below"
        )
    if ctl.kind == "adaptive" and ctl.adjust == "batch_size" and config.local.steps is None:
        raise ConfigError(
            "config key 'controller.adjust': batch_size needs local.steps: with local.epochs a client's time "
            "does not depend on its batch size"
        )
    if asy.enabled:
        if het.clock != "virtual":
            raise ConfigError(
                "config key 'asynchronous.enabled': asynchronous aggregation is simulated on a virtual clock; "
                "set heterogeneity.clock: virtual"
            )
        if (asy.buffer_size or config.clients_per_round) > n:
            raise ConfigError(
                f"config key 'asynchronous.buffer_size': {asy.buffer_size} updates per server step from {n} "
                "clients, each training a model version at most once"
            )
        if asy.concurrency is not None and asy.concurrency > n:
            raise ConfigError(f"config key 'asynchronous.concurrency': {asy.concurrency} is more than clients={n}")


def _check_data_parallel(config: Config) -> None:
    """Cross-key checks of ``mode: data_parallel``: worker indices, counts, batch bounds."""
    dp, het = config.data_parallel, config.heterogeneity
    n = dp.workers
    total = config.data_parallel_workers  # joining workers take the indices n, n + 1, ...
    joined = f" and {len(het.joins)} join{'s' if len(het.joins) > 1 else ''}" if het.joins else ""
    for i, join in enumerate(het.joins):
        if join.worker != n + i:
            raise ConfigError(
                f"config key 'heterogeneity.joins[{i}].worker': {join.worker}; joining workers take the next "
                f"indices in order, so this one is {n + i} (data_parallel.workers={n})"
            )
    for key, values in (("speeds", het.speeds), ("threads", het.threads)):
        if values and len(values) != total:
            raise ConfigError(
                f"config key 'heterogeneity.{key}': {len(values)} values for data_parallel.workers={n}{joined}; "
                "give one per worker or none"
            )
    if any(t < 1 for t in het.threads):
        raise ConfigError(f"config key 'heterogeneity.threads': thread counts must be >= 1, got {het.threads}")
    if any(s <= 0 for s in het.speeds):
        raise ConfigError(f"config key 'heterogeneity.speeds': speeds must be > 0, got {het.speeds}")
    for key, items in (("schedule", het.schedule), ("crashes", het.crashes)):
        for i, item in enumerate(items):
            if item.worker >= total:
                raise ConfigError(
                    f"config key 'heterogeneity.{key}[{i}].worker': {item.worker} is not a worker "
                    f"(data_parallel.workers={n}{joined}: 0..{total - 1})"
                )
    starts = {join.worker: join.step for join in het.joins}
    for i, crash in enumerate(het.crashes):
        if crash.step < starts.get(crash.worker, 0):
            raise ConfigError(
                f"config key 'heterogeneity.crashes[{i}].step': {crash.step} is before worker {crash.worker} "
                f"joins (step {starts[crash.worker]})"
            )
    if dp.min_workers > n:
        raise ConfigError(
            f"config key 'data_parallel.min_workers': {dp.min_workers} is more than data_parallel.workers={n}"
        )
    _check_sync(dp, het)
    ctl = dp.controller
    if dp.global_batch < total * ctl.min_batch:
        raise ConfigError(
            f"config key 'data_parallel.global_batch': {dp.global_batch} cannot give {total} workers "
            f"controller.min_batch={ctl.min_batch} each"
        )
    if ctl.max_batch is not None and dp.global_batch > n * ctl.max_batch:
        raise ConfigError(
            f"config key 'data_parallel.global_batch': {dp.global_batch} exceeds {n} workers x "
            f"controller.max_batch={ctl.max_batch}"
        )


def _check_sync(dp: DataParallelConfig, het: HeterogeneityConfig) -> None:
    """``data_parallel.sync``: asp's settings only with asp, and what asp cannot do."""
    if dp.sync == "bsp":
        defaults = DataParallelConfig()
        for key in [*(f.name for f in dataclasses.fields(StalenessOptions)), "buffer"]:
            if getattr(dp, key) != getattr(defaults, key):
                raise ConfigError(f"config key 'data_parallel.{key}': applies to data_parallel.sync: asp only")
        return
    if dp.optimizer == "adam":
        raise ConfigError(
            "config key 'data_parallel.optimizer': adam normalises each step's scale, which would undo asp's "
            "b_i / B and staleness weights; use sgd with sync: asp"
        )
    if het.joins:
        raise ConfigError("config key 'heterogeneity.joins': workers cannot join an asp run (sync: bsp only)")


# --------------------------------------------------------------------------- loading


def _parse_named(section: str, data: Any, registry: Any, spec_cls: type) -> Any:
    """Parse ``{name: X, **hyper-parameters}`` against the ``Params`` that X declares."""
    if isinstance(data, str):
        data = {"name": data}
    if not isinstance(data, dict):
        raise ConfigError(f"config key '{section}': expected a name or a mapping, got {data!r}")
    data = dict(data)
    name = data.pop("name", None)
    if name is None and spec_cls is StrategyConfig:
        name = "fedavg"
    if not isinstance(name, str):
        typo = difflib.get_close_matches("name", [str(k) for k in data], n=1, cutoff=0.5)
        if typo:
            raise unknown_key(section, typo[0], ["name"])
        raise ConfigError(f"config key '{section}.name' is required (a {registry.kind} name)")
    cls = registry.get(name, f"{section}.name")
    params_cls = getattr(cls, "Params", None)
    if params_cls is None or not dataclasses.is_dataclass(params_cls):
        raise ConfigError(
            f"config key '{section}.name': {name!r} declares no Params dataclass of its settings"
        )
    settings = [f.name for f in dataclasses.fields(params_cls)]
    for key in data:
        if key not in settings:
            raise unknown_key(section, str(key), ["name", *settings])
    params = parse(params_cls, data, section)
    return spec_cls(name=name, params=params)


def _parse_plugins(data: Any) -> PluginsConfig:
    from fedweave.plugins import PLUGINS

    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config key 'plugins': expected a mapping of attachment points, got {data!r}")
    points = [f.name for f in dataclasses.fields(PluginsConfig)]
    chains = {}
    for point, items in data.items():
        if point not in points:
            raise unknown_key("plugins", point, points)
        if items is None:
            items = []
        if not isinstance(items, list):
            raise ConfigError(f"config key 'plugins.{point}': expected a list of plugins, got {items!r}")
        chains[point] = [
            _parse_named(f"plugins.{point}[{i}]", item, PLUGINS, PluginSpec) for i, item in enumerate(items)
        ]
    return PluginsConfig(**chains)


def from_dict(data: dict[str, Any]) -> Config:
    """Validate plain data (from YAML, after overrides) into a :class:`Config`."""
    from fedweave.strategies import STRATEGIES

    if not isinstance(data, dict):
        raise ConfigError(f"a config is a mapping of keys, got {type(data).__name__}")
    data = dict(data)
    strategy = _parse_named("strategy", data.pop("strategy", "fedavg"), STRATEGIES, StrategyConfig)
    plugins = _parse_plugins(data.pop("plugins", None))
    config = parse(Config, data)
    config.strategy = strategy
    config.plugins = plugins
    check_composition(config)
    return config


def check_composition(config: Config) -> None:
    """Reject plugin chains the strategy cannot work with, saying why."""
    from fedweave.plugins import PLUGINS
    from fedweave.plugins.compose import check_chains
    from fedweave.strategies import STRATEGIES

    strategy = STRATEGIES.get(config.strategy.name, "strategy.name")
    check_strategy = getattr(strategy, "check_config", None)
    if check_strategy is not None:
        check_strategy(config)
    rule = config.aggregation.rule
    if rule in ("krum", "multi_krum") and config.clients_per_round <= 2 * config.aggregation.byzantine + 2:
        raise ConfigError(
            f"config key 'aggregation.byzantine': {rule} with f={config.aggregation.byzantine} needs more than "
            f"2f + 2 = {2 * config.aggregation.byzantine + 2} clients per round, the config samples "
            f"{config.clients_per_round}"
        )
    for point in ("server_send", "client_receive", "server_receive"):
        for i, spec in enumerate(getattr(config.plugins, point)):
            if PLUGINS.get(spec.name, f"plugins.{point}[{i}].name").combines_encoded:
                raise ConfigError(
                    f"config key 'plugins.{point}[{i}]': plugin {spec.name!r} combines client updates "
                    "while encoded, so it belongs in plugins.client_send"
                )
    for point in ("client_send", "server_receive"):
        for i, spec in enumerate(getattr(config.plugins, point)):
            plugin = PLUGINS.get(spec.name, f"plugins.{point}[{i}].name")
            if strategy.update_kind not in plugin.accepts:
                kinds = ", ".join(sorted(k.value for k in plugin.accepts))
                raise ConfigError(
                    f"config key 'plugins.{point}[{i}]': plugin {spec.name!r} accepts {kinds} updates, "
                    f"but strategy {config.strategy.name!r} sends {strategy.update_kind.value}"
                )
            if plugin.combines_encoded and config.aggregation.rule != "mean":
                raise ConfigError(
                    f"config key 'plugins.{point}[{i}]': plugin {spec.name!r} makes the server combine "
                    f"updates while encoded, so it only sees their sum; aggregation.rule "
                    f"{config.aggregation.rule!r} needs each update in the clear"
                )
            if plugin.combines_encoded and not strategy.weighted_sum:
                raise ConfigError(
                    f"config key 'plugins.{point}[{i}]': plugin {spec.name!r} makes the server combine "
                    f"updates while encoded, which needs a weighted-sum server step; strategy "
                    f"{config.strategy.name!r} does not aggregate by a weighted sum"
                )
    check_chains(config, PLUGINS, strategy)
    if config.asynchronous.enabled:
        _check_asynchronous(config, strategy, PLUGINS)


def _check_asynchronous(config: Config, strategy: Any, plugins: Any) -> None:
    """Asynchronous aggregation scales each delta by its staleness and has no rounds to set up."""
    if strategy.update_kind.value != "delta":
        raise ConfigError(
            f"config key 'asynchronous.enabled': a stale update is scaled down, which needs delta updates; "
            f"strategy {config.strategy.name!r} sends {strategy.update_kind.value}"
        )
    for point in ("server_send", "client_receive", "client_send", "server_receive"):
        for i, spec in enumerate(getattr(config.plugins, point)):
            plugin = plugins.get(spec.name, f"plugins.{point}[{i}].name")
            if plugin.combines_encoded or hasattr(plugin, "begin_round"):
                raise ConfigError(
                    f"config key 'plugins.{point}[{i}]': plugin {spec.name!r} works per synchronous round "
                    "(a cohort set up or accounted per round); asynchronous.enabled has no such rounds"
                )


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``dotted.key=value`` overrides (values parsed as YAML) to a copy of ``data``."""
    data = copy.deepcopy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. rounds=20)")
        try:
            value = parse_yaml(raw) if raw else ""
        except yaml.YAMLError:
            value = raw
        node: Any = data
        parts = key.split(".")
        shorthands = _shorthands(Config)
        for depth, part in enumerate(parts[:-1]):
            path = ".".join(parts[: depth + 1])
            if isinstance(node, list):
                child = node[_list_index(node, part, item, path)]
            else:
                child = node.get(part)
            if isinstance(child, str) and path in shorthands:
                child = {shorthands[path]: child}
                node[part] = child
            if child is None:
                child = {}
                node[part] = child
            if not isinstance(child, (dict, list)):
                raise ConfigError(f"override {item!r}: '{path}' is not a section")
            node = child
        last = parts[-1]
        if isinstance(node, list):
            node[_list_index(node, last, item, key)] = value
        else:
            node[last] = value
    return data


def _list_index(items: list[Any], part: str, override: str, path: str) -> int:
    """``part`` as an index into ``items``; a ConfigError naming the override when it is not one."""
    if not part.isdigit() or int(part) >= len(items):
        raise ConfigError(
            f"override {override!r}: '{path}' is not an item of a list of {len(items)} "
            f"(indices 0..{len(items) - 1})"
        )
    return int(part)


def _shorthands(cls: type, prefix: str = "") -> dict[str, str]:
    """Dotted section key -> the field a bare string there stands for (``strategy`` -> ``name``)."""
    out = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            key = f"{prefix}{f.name}"
            if getattr(tp, "SHORTHAND", None):
                out[key] = tp.SHORTHAND
            out.update(_shorthands(tp, f"{key}."))
    return out


class _Loader(yaml.SafeLoader):
    """Safe YAML that also reads ``1e-3`` as a number (YAML 1.1 needs a dot: ``1.0e-3``)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def parse_yaml(text: str) -> Any:
    """YAML text as plain data (safe loading; exponent floats without a dot are numbers)."""
    return yaml.load(text, Loader=_Loader)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML file; a ConfigError when it is missing or not a mapping."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"cannot read config file {str(path)!r}: it is not UTF-8 text") from None
    try:
        data = parse_yaml(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"config file {str(path)!r}{where}: not valid YAML") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r}: expected a mapping of keys at the top level")
    return data


def quickstart_data() -> dict[str, Any]:
    """The embedded quickstart config."""
    return parse_yaml(resources.files("fedweave").joinpath("quickstart.yaml").read_text())


def load(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load ``path`` (the quickstart when None), apply overrides, validate."""
    data = quickstart_data() if path is None else read_yaml(path)
    return from_dict(apply_overrides(data, overrides or []))


def to_yaml(config: Config) -> str:
    """The resolved config as YAML, loadable by :func:`load`."""
    data = to_dict(config)
    data["strategy"] = {"name": config.strategy.name, **to_dict(config.strategy.params)}
    data["plugins"] = {
        point: [{"name": s.name, **to_dict(s.params)} for s in getattr(config.plugins, point)]
        for point in ("server_send", "client_receive", "client_send", "server_receive")
    }
    return yaml.safe_dump(data, sort_keys=False)
