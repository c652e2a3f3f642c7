"""Dotted ``key=value`` overrides; switching a strategy or plugin by name drops the old one's settings."""

from __future__ import annotations

import copy
import dataclasses
import logging
import typing
from typing import Any

import yaml

from fedweave.config.root import Config
from fedweave.config.yaml_safe import parse_yaml
from fedweave.errors import ConfigError

log = logging.getLogger(__name__)


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
        declared = {f.name for f in dataclasses.fields(registry.get(name, f"{section}.name").HParams)}
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
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            key = f"{prefix}{f.name}"
            shorthand = getattr(tp, "SHORTHAND", None)
            if shorthand:
                out[key] = shorthand
            out.update(_shorthands(tp, f"{key}."))
    return out
