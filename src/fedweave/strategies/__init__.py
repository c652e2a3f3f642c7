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
        "fedavgm": "fedweave.strategies.fedavgm:FedAvgM",
        "fedadam": "fedweave.strategies.fedopt:FedAdam",
        "fedyogi": "fedweave.strategies.fedopt:FedYogi",
        "fedadagrad": "fedweave.strategies.fedopt:FedAdagrad",
        "fedprox": "fedweave.strategies.fedprox:FedProx",
        "scaffold": "fedweave.strategies.scaffold:Scaffold",
        "fednova": "fedweave.strategies.fednova:FedNova",
        "feddyn": "fedweave.strategies.feddyn:FedDyn",
        "moon": "fedweave.strategies.moon:Moon",
        "ditto": "fedweave.strategies.ditto:Ditto",
        "fedper": "fedweave.strategies.fedper:FedPer",
        "fedbn": "fedweave.strategies.fedbn:FedBN",
        "diloco": "fedweave.strategies.diloco:DiLoCo",
    },
)
