"""Algorithms: one module each, holding the server half and the client half.

A strategy class is named in the config (``strategy.name``) by its built-in name or
by an import path ``package.module:Class``. See :mod:`fedweave.strategies.base` for
the protocol a strategy follows.
"""

from fedweave.registry import Registry

STRATEGIES = Registry(
    "strategy",
    {
        "fedavg": "fedweave.strategies.fedavg:FedAvg",
    },
)
