"""Transforms of payloads on the wire: privacy, secure aggregation, encryption, compression.

Plugins are named in the config under one of four attachment points (see
:mod:`fedweave.plugins.chain`) by built-in name or ``package.module:Class``.
"""

from fedweave.registry import Registry

PLUGINS = Registry(
    "plugin",
    {
        "identity": "fedweave.plugins.identity:Identity",
    },
)
