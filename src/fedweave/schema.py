"""A small typed-schema validator for config dataclasses.

A config section is a dataclass whose fields carry their constraints in
``field(metadata=...)`` (see :func:`opt`). :func:`parse` turns plain YAML data into
an instance, and every problem becomes one :class:`~fedweave.errors.ConfigError` line
that names the dotted key: unknown keys (with the closest valid key suggested), wrong
types, values out of range or outside their choices.

Strategies and plugins declare their hyper-parameters with the same dataclasses, so
their settings are validated by the same code when the config is loaded.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
import types
import typing
from typing import Any, Literal, Union

from fedweave.errors import ConfigError


def opt(
    default: Any = dataclasses.MISSING,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    help: str = "",
    factory: Any = dataclasses.MISSING,
) -> Any:
    """A dataclass field with bounds and a help text."""
    meta = {"ge": ge, "gt": gt, "le": le, "lt": lt, "help": help}
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if tp is type(None):
        return "null"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list ({_describe(typing.get_args(tp)[0])} each)"
    if origin is dict:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def _check_bounds(value: Any, meta: typing.Mapping[str, Any], key: str) -> None:
    checks = (
        ("ge", lambda v, b: v >= b, ">="),
        ("gt", lambda v, b: v > b, ">"),
        ("le", lambda v, b: v <= b, "<="),
        ("lt", lambda v, b: v < b, "<"),
    )
    for name, ok, symbol in checks:
        bound = meta.get(name)
        if bound is not None and isinstance(value, (int, float)) and not ok(value, bound):
            raise ConfigError(f"config key '{key}': must be {symbol} {bound}, got {value!r}")


def _coerce(tp: Any, value: Any, key: str) -> Any:
    """Check ``value`` against type ``tp``; return it (ints widen to floats)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, key)
            except ConfigError:
                continue
        raise ConfigError(f"config key '{key}': expected {_describe(tp)}, got {value!r}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            close = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"config key '{key}': {value!r} is not allowed; expected {_describe(tp)}{hint}"
            )
        return value
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key '{key}': expected {_describe(tp)}, got {value!r}")
        (item,) = typing.get_args(tp)
        return [_coerce(item, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}': expected a mapping, got {value!r}")
        return dict(value)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return parse(tp, value, key)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"config key '{key}': expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config key '{key}': expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"config key '{key}': expected a number, got {value!r}")
        if not -sys.float_info.max <= value <= sys.float_info.max:  # nan, inf, or an integer beyond every float
            raise ConfigError(f"config key '{key}': expected a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"config key '{key}': expected a string, got {value!r}")
        return value
    raise TypeError(f"schema type {tp!r} of '{key}' is not supported")


def parse(cls: type, data: Any, prefix: str = "", *, shorthand: str | None = None) -> Any:
    """Build dataclass ``cls`` from ``data``, validating every key below ``prefix``.

    ``shorthand`` names the field a bare string stands for (``strategy: fedavg`` is
    ``strategy: {name: fedavg}``).
    """
    label = prefix or "<root>"
    shorthand = shorthand or getattr(cls, "SHORTHAND", None)
    if isinstance(data, str) and shorthand:
        data = {shorthand: data}
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config key '{label}': expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for name in data:
        if name not in fields:
            raise unknown_key(prefix, str(name), list(fields))
    values = {}
    for name, f in fields.items():
        key = f"{prefix}.{name}" if prefix else name
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"config key '{key}' is required ({_describe(hints[name])})")
            continue
        values[name] = _field_value(hints[name], f, data[name], key)
    instance = cls(**values)
    check = getattr(instance, "validate", None)
    if check is not None:
        check(prefix)
    return instance


def _field_value(tp: Any, f: dataclasses.Field, value: Any, key: str) -> Any:
    value = _coerce(tp, value, key)
    _check_bounds(value, f.metadata, key)
    return value


def checked(cls: type, name: str, value: Any, key: str) -> Any:
    """``value`` of field ``name`` of ``cls``, checked as :func:`parse` checks it (one ConfigError naming ``key``)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return _field_value(typing.get_type_hints(cls)[name], f, value, key)


def unknown_key(prefix: str, name: str, valid: list[str]) -> ConfigError:
    """The error for a key that the schema does not know, with the closest valid key."""
    key = f"{prefix}.{name}" if prefix else name
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
    hint = f" (did you mean '{prefix + '.' if prefix else ''}{close[0]}'?)" if close else ""
    return ConfigError(
        f"unknown config key {key!r}{hint}; valid keys here: {', '.join(sorted(valid))}"
    )


def to_dict(instance: Any) -> Any:
    """Plain data (for YAML) from a parsed config dataclass."""
    if dataclasses.is_dataclass(instance):
        return {f.name: to_dict(getattr(instance, f.name)) for f in dataclasses.fields(instance)}
    if isinstance(instance, (list, tuple)):
        return [to_dict(v) for v in instance]
    if isinstance(instance, dict):
        return {k: to_dict(v) for k, v in instance.items()}
    return instance


def describe_fields(cls: type, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """``(key, type, default, help)`` for every field of ``cls``, nested sections flattened."""
    rows = []
    hints = typing.get_type_hints(cls)
    own = set(cls.__dict__.get("__annotations__", {}))  # a section's own keys before those it inherits
    for f in sorted(dataclasses.fields(cls), key=lambda f: f.name not in own):
        key = f"{prefix}.{f.name}" if prefix else f.name
        tp = hints[f.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            rows.extend(describe_fields(tp, key))
            continue
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        )
        rows.append((key, _describe(tp), default, f.metadata.get("help", "")))
    return rows
