"""The run configuration: schema, YAML loading, dotted overrides, validation.

Everything is checked when the config is loaded, so nothing fails an hour into a
run for a typo. Each problem is one :class:`~fedweave.errors.ConfigError` line that
names the key. ``fedweave run --print-config`` shows the resolved result.

One concept a module: :mod:`~fedweave.config.sections` (what a run trains and how),
:mod:`~fedweave.config.deployment` (topology, transports, launchers),
:mod:`~fedweave.config.heterogeneity` (controllers, staleness, data parallelism),
:mod:`~fedweave.config.root` (the whole :class:`Config` and its checks across sections),
:mod:`~fedweave.config.yaml_safe` (reading YAML safely), :mod:`~fedweave.config.overrides`
(dotted overrides) and :mod:`~fedweave.config.loading` (from plain data or a file to a
:class:`Config`, and back to YAML).
"""

from __future__ import annotations

from fedweave.config.deployment import (
    GrpcConfig,
    LauncherConfig,
    RayConfig,
    TopologyConfig,
    TorchDistConfig,
    TransportConfig,
    parse_address,
)
from fedweave.config.heterogeneity import (
    AsynchronousConfig,
    BatchControllerConfig,
    ClientControllerConfig,
    Crash,
    DataParallelConfig,
    HeterogeneityConfig,
    Join,
    SpeedChange,
    StalenessOptions,
)
from fedweave.config.loading import from_dict, load, quickstart_data, to_yaml
from fedweave.config.overrides import apply_overrides
from fedweave.config.root import RUN_NAME, Config, emulates_clients
from fedweave.config.sections import (
    AggregationConfig,
    AttackKind,
    AttacksConfig,
    CheckpointConfig,
    EvalConfig,
    LocalConfig,
    MlflowConfig,
    ObserveConfig,
    PartitionConfig,
    PeftConfig,
    PluginsConfig,
    PluginSpec,
    SelectionConfig,
    SimulationConfig,
    StrategyConfig,
    TaskConfig,
)
from fedweave.config.yaml_safe import MAX_YAML_DEPTH, MAX_YAML_VALUES, YamlRefused, parse_yaml, read_yaml
from fedweave.errors import ConfigError

__all__ = [
    "MAX_YAML_DEPTH",
    "MAX_YAML_VALUES",
    "RUN_NAME",
    "AggregationConfig",
    "AsynchronousConfig",
    "AttackKind",
    "AttacksConfig",
    "BatchControllerConfig",
    "CheckpointConfig",
    "ClientControllerConfig",
    "Config",
    "ConfigError",
    "Crash",
    "DataParallelConfig",
    "EvalConfig",
    "GrpcConfig",
    "HeterogeneityConfig",
    "Join",
    "LauncherConfig",
    "LocalConfig",
    "MlflowConfig",
    "ObserveConfig",
    "PartitionConfig",
    "PeftConfig",
    "PluginSpec",
    "SelectionConfig",
    "SimulationConfig",
    "PluginsConfig",
    "RayConfig",
    "SpeedChange",
    "StalenessOptions",
    "StrategyConfig",
    "TaskConfig",
    "TopologyConfig",
    "TorchDistConfig",
    "TransportConfig",
    "YamlRefused",
    "apply_overrides",
    "emulates_clients",
    "from_dict",
    "load",
    "parse_address",
    "parse_yaml",
    "quickstart_data",
    "read_yaml",
    "to_yaml",
]
