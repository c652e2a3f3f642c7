"""The whole :class:`Config` and its checks across sections."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from fedweave.config.deployment import (
    GrpcConfig,
    LauncherConfig,
    RayConfig,
    TopologyConfig,
    TorchDistConfig,
    TransportConfig,
)
from fedweave.config.heterogeneity import (
    AsynchronousConfig,
    ClientControllerConfig,
    Crash,
    DataParallelConfig,
    HeterogeneityConfig,
    SpeedChange,
    StalenessOptions,
)
from fedweave.config.sections import (
    AggregationConfig,
    AttacksConfig,
    CheckpointConfig,
    EvalConfig,
    LocalConfig,
    ObserveConfig,
    PluginsConfig,
    SelectionConfig,
    SimulationConfig,
    StrategyConfig,
    TaskConfig,
)
from fedweave.errors import ConfigError
from fedweave.schema import opt


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
    simulation: SimulationConfig = opt(factory=SimulationConfig)
    strategy: StrategyConfig = opt(factory=StrategyConfig)
    aggregation: AggregationConfig = opt(factory=AggregationConfig)
    selection: SelectionConfig = opt(factory=SelectionConfig)
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
        _check_simulation(self)
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


def _check_simulation(config: Config) -> None:
    """The ``simulation`` keys against the run: worker processes serve an in-memory simulation's
    clients, which this process reaches directly, at most one a client; emulated client speeds
    time each client alone, in this process, in no cohort."""
    simulated = config.mode == "federated" and config.transport.kind == "inmemory"
    if isinstance(config.simulation.cohort, int) and simulated and emulates_clients(config):
        raise ConfigError(
            "config key 'simulation.cohort': emulated client speeds (heterogeneity.*) time each client in this "
            "process, one after another; set it to auto or off"
        )
    if config.simulation.workers == 1:
        return
    if not simulated or config.launcher.kind != "local":
        raise ConfigError(
            "config key 'simulation.workers': worker processes train the clients of a federated in-memory simulation "
            f"(transport inmemory, launcher local), not of mode {config.mode}, transport {config.transport.kind}, "
            f"launcher {config.launcher.kind}; set it to 1"
        )
    if config.simulation.workers > config.clients:
        raise ConfigError(
            f"config key 'simulation.workers': {config.simulation.workers} worker processes for clients="
            f"{config.clients}; at most one a client (a worker without clients would idle)"
        )
    if emulates_clients(config):
        raise ConfigError(
            "config key 'simulation.workers': emulated client speeds (heterogeneity.*) time each client in this "
            "process, one after another; set it to 1"
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
        if config.selection.name != "uniform":
            raise ConfigError(
                f"config key 'selection.name': {config.selection.name!r} chooses the clients of synchronous rounds; "
                "asynchronous aggregation gives each free client its next job (leave selection uniform)"
            )
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
    if config.local.device != "cpu":
        raise ConfigError(
            f"config key 'local.device': applies to mode federated; data_parallel places each worker on a device "
            f"by its backend (nccl: one GPU a rank), not {config.local.device!r}"
        )
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
    timed: tuple[tuple[str, Sequence[SpeedChange | Crash]], ...] = (("schedule", het.schedule), ("crashes", het.crashes))
    for key, items in timed:
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
