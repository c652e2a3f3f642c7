"""Loading a config: parse plain data into a validated :class:`Config`, load a file, write it back."""

from __future__ import annotations

import dataclasses
import difflib
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from fedweave.config.overrides import apply_overrides
from fedweave.config.root import Config
from fedweave.config.sections import PluginSpec, PluginsConfig, StrategyConfig
from fedweave.config.yaml_safe import parse_yaml, read_yaml
from fedweave.errors import ConfigError
from fedweave.schema import parse, to_dict, unknown_key


def _parse_named(section: str, data: Any, registry: Any, spec_cls: type) -> Any:
    """Parse ``{name: X, **hyper-parameters}`` against the ``HParams`` that X declares."""
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
    params_cls = getattr(cls, "HParams", None)
    if not (isinstance(params_cls, type) and dataclasses.is_dataclass(params_cls)):
        raise ConfigError(
            f"config key '{section}.name': {name!r} declares no HParams dataclass of its settings"
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
