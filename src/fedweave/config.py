"""The run configuration: schema, YAML loading, dotted overrides, validation.

Everything is checked when the config is loaded, so nothing fails an hour into a
run for a typo. Each problem is one :class:`~fedweave.errors.ConfigError` line that
names the key. ``fedweave run --print-config`` shows the resolved result.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import logging
import re
import typing
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml

from fedweave.errors import ConfigError
from fedweave.schema import opt, parse, to_dict, unknown_key

log = logging.getLogger(__name__)


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
        help="digits | mnist5k | synthetic | torchvision:mnist | torchvision:cifar10 | package.module:function "
        "called f(seed=..., **dataset_options) returning (x_train, y_train, x_test, y_test), or (x, y) whose "
        "test split is carved by test_fraction, or a fedweave.task.Dataset; x float arrays, y integer labels",
    )
    dataset_options: dict[str, Any] = opt(factory=dict, help="keyword arguments of the dataset")
    data_root: str | None = opt(None, help="local folder of torchvision datasets")
    model: str = opt(
        "mlp",
        help="mlp | cnn | package.module:function called f(**model_options, input_shape=(...), "
        "num_classes=N) returning a torch.nn.Module whose output is (batch, num_classes) logits",
    )
    model_options: dict[str, Any] = opt(factory=dict, help="keyword arguments of the model")
    loss: str = opt(
        "cross_entropy",
        help="training loss: cross_entropy | nll | bce (binary cross-entropy of each logit against the one-hot "
        "label) | package.module:function called f(outputs, labels) returning the batch's mean loss",
    )
    test_fraction: float = opt(0.2, gt=0, lt=1, help="share of the data held out as the global test set")
    local_test_fraction: float = opt(0.2, ge=0, lt=1, help="share of each client's data kept as its local test split")
    partition: PartitionConfig = opt(factory=PartitionConfig)

    def validate(self, prefix: str) -> None:
        from fedweave.task.models import LOSSES

        if self.loss not in LOSSES and ":" not in self.loss:
            raise ConfigError(
                f"config key '{prefix}.loss': {self.loss!r} is not a loss; valid: {', '.join(LOSSES)} "
                "or package.module:function"
            )


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
    max_examples: int | None = opt(
        None,
        ge=1,
        help="most examples one client may claim; a larger claim counts as this many (an encoded one is "
        "rejected). In-memory simulations also cap each claim at the client's true partition size",
    )
    max_weight_share: float | None = opt(
        None,
        gt=0,
        le=1,
        help="largest share of a round's total weight one update may carry; larger weights are lowered to "
        "a common cap (none: no cap; needs updates in the clear)",
    )

    def validate(self, prefix: str) -> None:
        if self.multi_krum_m is not None and self.rule != "multi_krum":
            raise ConfigError(
                f"config key '{prefix}.multi_krum_m': only rule 'multi_krum' uses it, but the rule is {self.rule!r}"
            )


AttackKind = Literal["none", "sign_flip", "scaling", "noise", "label_flip", "inflate_examples"]


@dataclass
class AttacksConfig:
    """Simulated attackers, for measuring defences: see :mod:`fedweave.plugins.attacks.poison`."""

    SHORTHAND = "kind"
    kind: AttackKind | list[AttackKind] = opt(
        "none",
        help="what the attacking clients do, one or a list: none | sign_flip (send -scale x the update) | "
        "scaling (scale x) | noise (add seeded N(0, std^2)) | label_flip (train on labels C-1-y) | "
        "inflate_examples (claim examples)",
    )
    clients: list[int] = opt(factory=list, help="ids of the attacking clients")
    scale: float = opt(1.0, gt=0, help="sign_flip, scaling: the factor applied to the update")
    std: float = opt(1.0, gt=0, help="noise: standard deviation of the noise added to each entry")
    examples: int = opt(1_000_000, ge=1, help="inflate_examples: the example count claimed")

    @property
    def kinds(self) -> list[str]:
        """The attacks, in the order they apply (none: empty)."""
        kinds = self.kind if isinstance(self.kind, list) else [self.kind]
        return [k for k in kinds if k != "none"]

    def validate(self, prefix: str) -> None:
        kinds = self.kind if isinstance(self.kind, list) else [self.kind]
        if len(set(kinds)) != len(kinds) or ("none" in kinds and len(kinds) > 1):
            raise ConfigError(f"config key '{prefix}.kind': {self.kind} names an attack twice or with none")
        if (not self.kinds) != (not self.clients):
            raise ConfigError(
                f"config key '{prefix}.clients': an attack needs attacking clients and clients need an attack "
                f"(kind {self.kind!r}, clients {self.clients})"
            )
        if len(set(self.clients)) != len(self.clients):
            raise ConfigError(f"config key '{prefix}.clients': {self.clients} names a client twice")
        if "scaling" in kinds and self.scale == 1:
            raise ConfigError(f"config key '{prefix}.scale': scaling by 1 changes nothing; set another factor")


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
        2048.0, gt=0, help="largest message a node accepts, in MiB (raise it for a model over ~500M float32 values)"
    )
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
class MlflowConfig:
    """MLflow tracking (extra ``mlflow``): see :mod:`fedweave.observe.mlflow`."""

    enabled: bool | None = opt(None, help="log to MLflow (none: when tracking_uri or experiment is set)")
    tracking_uri: str | None = opt(None, help="tracking URI (none: a local file: store, RUN_DIR/mlruns)")
    experiment: str | None = opt(None, help="experiment name (none: the run's name)")

    @property
    def on(self) -> bool:
        return self.enabled if self.enabled is not None else bool(self.tracking_uri or self.experiment)


@dataclass
class ObserveConfig:
    """Where a run's metrics go besides metrics.jsonl (see :mod:`fedweave.observe.loggers`)."""

    tensorboard: bool | str = opt(
        False, help="TensorBoard event files (extra tensorboard): true for RUN_DIR/tensorboard, or a folder"
    )
    mlflow: MlflowConfig = opt(factory=MlflowConfig)
    prometheus_port: int | None = opt(
        None, ge=1, le=65535, help="serve Prometheus metrics on this port from the server (extra prometheus)"
    )

    def validate(self, prefix: str) -> None:
        if self.tensorboard == "":
            raise ConfigError(f"config key '{prefix}.tensorboard': expected true, false or a folder, got ''")


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
    (``sync: bsp``) or a parameter server (``sync: asp``, see :mod:`fedweave.data_parallel.asp`)."""

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
    checkpoint_every: int = opt(
        0, ge=0, help="steps between checkpoints, which an elastic torchrun job resumes from after a world change "
        "(0: at epoch ends, as checkpoint.every says)"
    )
    sync: Literal["bsp", "asp"] = opt(
        "bsp",
        help="bsp: synchronous steps, every worker waits for the slowest | asp: a parameter server applies each "
        "worker's gradient as it arrives, nobody waits (see fedweave.data_parallel.asp)",
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


RUN_NAME = re.compile(r"\w(?:[\w .+-]{0,98}[\w.+-])?")
"""A run name: one folder name, without path separators, '..', control characters or a leading '-'."""


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
    attacks: AttacksConfig = opt(factory=AttacksConfig)
    plugins: PluginsConfig = opt(factory=PluginsConfig)
    topology: TopologyConfig = opt(factory=TopologyConfig)
    transport: TransportConfig = opt(factory=TransportConfig)
    launcher: LauncherConfig = opt(factory=LauncherConfig)
    ray: RayConfig = opt(factory=RayConfig)
    grpc: GrpcConfig = opt(factory=GrpcConfig)
    torchdist: TorchDistConfig = opt(factory=TorchDistConfig)
    eval: EvalConfig = opt(factory=EvalConfig)
    checkpoint: CheckpointConfig = opt(factory=CheckpointConfig)
    observe: ObserveConfig = opt(factory=ObserveConfig)
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
        if not RUN_NAME.fullmatch(self.name):
            raise ConfigError(
                f"config key 'name': {self.name!r} is not a run name; it names the run's folder, so it takes "
                "letters, digits, spaces, '_', '.', '+', '-' (at most 100; first a letter, digit or '_'; no space last)"
            )
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
        if self.mode == "data_parallel":
            _check_data_parallel(self)
        if self.topology.kind == "hierarchical":
            _check_sites(self)
        _check_heterogeneity_aware(self)
        if self.attacks.kinds:
            _check_attacks(self)


def _check_attacks(config: Config) -> None:
    """Attacking clients are clients of a federated run."""
    if config.mode != "federated":
        raise ConfigError("config key 'attacks.kind': attacks are simulated in mode federated")
    strangers = [c for c in config.attacks.clients if not 0 <= c < config.clients]
    if strangers:
        raise ConfigError(
            f"config key 'attacks.clients': {strangers} are not client ids (0..{config.clients - 1})"
        )


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
        if het.clock != "virtual" and config.transport.kind == "inmemory":
            raise ConfigError(
                "config key 'asynchronous.enabled': asynchronous aggregation is simulated on a virtual clock; "
                "set heterogeneity.clock: virtual (or deploy it: transport: grpc)"
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
            raise unknown_key("plugins", str(point), points)
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
    from fedweave import rules  # imports the plugin and strategy protocols (torch): not for `fedweave --help`

    rules.check(config)
    return config


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``dotted.key=value`` overrides (values parsed as YAML) to a copy of ``data``."""
    data = copy.deepcopy(data)
    touched: set[str] = set()
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
                raise ConfigError(f"override {item!r}: {path!r} is not a section")
            node = child
        last = parts[-1]
        if isinstance(node, list):
            node[_list_index(node, last, item, key)] = value
        else:
            if last == "name" and _names_a_choice(parts[:-1]):
                _drop_settings_of_previous_choice(node, value, ".".join(parts[:-1]), touched, item)
            node[last] = value
        touched.add(key)
    return data


def _names_a_choice(section: list[str]) -> bool:
    """Whether ``section`` is one whose ``name`` chooses what its other keys configure."""
    return section == ["strategy"] or (len(section) == 3 and section[0] == "plugins" and section[2].isdigit())


def _drop_settings_of_previous_choice(
    node: dict[str, Any], name: Any, section: str, touched: set[str], override: str
) -> None:
    """Switching a strategy or a plugin by ``section.name=...``: drop the settings of the previous
    choice (those not set by an override in the same list) that the new one does not declare,
    with a one-line note, so the new choice is not refused for keys it never had."""
    from fedweave.plugins import PLUGINS
    from fedweave.strategies import STRATEGIES

    previous = node.get("name", "fedavg" if section == "strategy" else None)
    if not isinstance(name, str) or name == previous:
        return
    registry = STRATEGIES if section == "strategy" else PLUGINS
    try:
        declared = {f.name for f in dataclasses.fields(registry.get(name, f"{section}.name").Params)}
    except (ConfigError, AttributeError, TypeError):
        return  # the new name is checked, with its one line, when the config is parsed
    dropped = [k for k in node if k != "name" and k not in declared and f"{section}.{k}" not in touched]
    for k in dropped:
        del node[k]
    if dropped:
        log.warning(
            "override %r: dropped %s, settings of %r that %r does not have (set them after the name to keep them)",
            override, ", ".join(f"{section}.{k}" for k in dropped), previous, name,
        )


def _list_index(items: list[Any], part: str, override: str, path: str) -> int:
    """``part`` as an index into ``items``; a ConfigError naming the override when it is not one."""
    if not part.isdigit() or int(part) >= len(items):
        raise ConfigError(
            f"override {override!r}: {path!r} is not an item of a list of {len(items)} "
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


MAX_YAML_VALUES = 1_000_000
"""Most values (scalars and collections, aliases counted as the values they repeat) a YAML text may hold."""
MAX_YAML_DEPTH = 100
"""Deepest nesting of collections a YAML text may have."""


class YamlRefused(yaml.YAMLError):
    """A YAML text that would take unbounded time or memory to use: an alias bomb, a cycle, deep nesting."""


class _Loader(yaml.SafeLoader):
    """Safe YAML that also reads ``1e-3`` as a number (YAML 1.1 needs a dot: ``1.0e-3``), and
    refuses a document whose aliases expand past :data:`MAX_YAML_VALUES` values (a "billion
    laughs" of twelve lines) or that nests deeper than :data:`MAX_YAML_DEPTH`, before any of it
    is built."""

    def compose_document(self) -> yaml.Node:
        try:
            node = super().compose_document()
        except RecursionError:
            raise YamlRefused(f"it nests deeper than {MAX_YAML_DEPTH} levels") from None
        _expanded_size(node, {}, set(), 0)
        return node


def _expanded_size(node: yaml.Node, sizes: dict[int, int], open_nodes: set[int], depth: int) -> int:
    """Values under ``node`` with every alias expanded; linear in the distinct nodes (memoized)."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_nodes:
        raise YamlRefused("an alias refers to a collection that contains it (a cycle)")
    if depth > MAX_YAML_DEPTH:
        raise YamlRefused(f"it nests deeper than {MAX_YAML_DEPTH} levels")
    size = 1
    if isinstance(node, (yaml.SequenceNode, yaml.MappingNode)):
        open_nodes.add(key)
        children = node.value if isinstance(node, yaml.SequenceNode) else [n for pair in node.value for n in pair]
        for child in children:
            size += _expanded_size(child, sizes, open_nodes, depth + 1)
            if size > MAX_YAML_VALUES:
                raise YamlRefused(
                    f"its aliases expand to more than {MAX_YAML_VALUES} values (an alias bomb?)"
                )
        open_nodes.discard(key)
    sizes[key] = size
    return size


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def parse_yaml(text: str) -> Any:
    """YAML text as plain data (safe loading; exponent floats without a dot are numbers)."""
    try:
        return yaml.load(text, Loader=_Loader)
    except ValueError as exc:  # a value YAML reads but Python cannot build: a 5000-digit integer, 2026-13-45
        raise yaml.constructor.ConstructorError(problem=str(exc).splitlines()[0]) from None


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
    except YamlRefused as exc:
        raise ConfigError(f"config file {str(path)!r}: refused, {exc}") from None
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
