"""The run configuration: schema, YAML loading, dotted overrides, validation.

Everything is checked when the config is loaded, so nothing fails an hour into a
run for a typo. Each problem is one :class:`~fedweave.errors.ConfigError` line that
names the key. ``fedweave run --print-config`` shows the resolved result.
"""

from __future__ import annotations

import copy
import dataclasses
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
    SHORTHAND = "rule"
    rule: Literal["mean"] = opt("mean", help="how client tensors are combined: mean (weighted by examples)")


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
    SHORTHAND = "kind"
    kind: Literal["star"] = opt("star", help="who aggregates for whom")


@dataclass
class TransportConfig:
    SHORTHAND = "kind"
    kind: Literal["inmemory"] = opt("inmemory", help="how messages travel")


@dataclass
class LauncherConfig:
    SHORTHAND = "kind"
    kind: Literal["local"] = opt("local", help="where nodes run: local = in-process simulation")


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
class Config:
    name: str = opt("quickstart", help="run name; the run directory is <output_dir>/<name>-<timestamp>")
    seed: int = opt(0, ge=0, help="seed of every random choice")
    mode: Literal["federated"] = opt("federated", help="training mode")
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
    eval: EvalConfig = opt(factory=EvalConfig)
    checkpoint: CheckpointConfig = opt(factory=CheckpointConfig)

    @property
    def clients_per_round(self) -> int:
        return max(self.min_clients, round(self.sample_fraction * self.clients))

    def validate(self, prefix: str) -> None:
        if self.min_clients > self.clients:
            raise ConfigError(
                f"config key 'min_clients': {self.min_clients} is more than clients={self.clients}; "
                "a round cannot sample more clients than exist"
            )


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
        raise ConfigError(f"config key '{section}.name' is required (a {registry.kind} name)")
    cls = registry.get(name, f"{section}.name")
    params_cls = getattr(cls, "Params", None)
    if params_cls is None or not dataclasses.is_dataclass(params_cls):
        raise ConfigError(
            f"config key '{section}.name': {name!r} declares no Params dataclass of its settings"
        )
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
    from fedweave.strategies import STRATEGIES

    strategy = STRATEGIES.get(config.strategy.name, "strategy.name")
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


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``dotted.key=value`` overrides (values parsed as YAML) to a copy of ``data``."""
    data = copy.deepcopy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. rounds=20)")
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError:
            value = raw
        node: Any = data
        parts = key.split(".")
        for depth, part in enumerate(parts[:-1]):
            child = node[int(part)] if isinstance(node, list) else node.get(part)
            if isinstance(child, str) and depth == 0 and part in _SHORTHANDS:
                child = {_SHORTHANDS[part]: child}
                node[part] = child
            if child is None:
                child = {}
                node[part] = child
            if not isinstance(child, (dict, list)):
                raise ConfigError(f"override {item!r}: '{'.'.join(parts[: depth + 1])}' is not a section")
            node = child
        last = parts[-1]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
    return data


_SHORTHANDS = {"strategy": "name", "aggregation": "rule", "topology": "kind", "transport": "kind", "launcher": "kind"}


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML file; a ConfigError when it is missing or not a mapping."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
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
    return yaml.safe_load(resources.files("fedweave").joinpath("quickstart.yaml").read_text())


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
