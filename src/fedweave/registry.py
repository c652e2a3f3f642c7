"""Named, lazily imported building blocks (strategies, plugins) and user import paths."""

from __future__ import annotations

import difflib
import importlib
from typing import Any

from fedweave.errors import ConfigError


def import_object(spec: str, key: str) -> Any:
    """Import ``package.module:attribute``; a ConfigError naming ``key`` when it cannot."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"config key '{key}': {spec!r} is not of the form 'package.module:name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"config key '{key}': cannot import module {module_name!r} ({exc})") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"config key '{key}': module {module_name!r} has no {attr!r}") from None


class Registry:
    """Built-in names mapped to import paths; any ``package.module:Name`` works too."""

    def __init__(self, kind: str, builtins: dict[str, str]):
        self.kind = kind
        self._builtins = builtins

    def names(self) -> list[str]:
        return sorted(self._builtins)

    def get(self, name: str, key: str) -> Any:
        """The object registered as ``name`` (or imported from it); ``key`` names the config key."""
        if ":" in name:
            return import_object(name, key)
        if name not in self._builtins:
            close = difflib.get_close_matches(name, self._builtins, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"config key '{key}': unknown {self.kind} {name!r}{hint}; built-in: "
                f"{', '.join(self.names())}, or give 'package.module:Class'"
            )
        return import_object(self._builtins[name], key)
