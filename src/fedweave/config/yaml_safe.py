"""Reading YAML safely: alias bombs, cycles and deep nesting refused before anything is built."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from fedweave.errors import ConfigError, first_line


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

    def compose_document(self) -> yaml.Node | None:
        try:
            node = super().compose_document()
        except RecursionError:
            raise YamlRefused(f"it nests deeper than {MAX_YAML_DEPTH} levels") from None
        if node is not None:
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
        raise yaml.constructor.ConstructorError(problem=first_line(exc)) from None


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
