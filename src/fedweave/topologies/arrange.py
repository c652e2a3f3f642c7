"""Arrange a run's clients into the configured topology over a transport to the clients."""

from __future__ import annotations

from fedweave.config import Config
from fedweave.errors import ConfigError
from fedweave.topologies.base import Topology
from fedweave.topologies.hierarchical import (
    Hierarchical,
    exact_pre_aggregation,
    site_tree,
)
from fedweave.topologies.ring import Ring
from fedweave.topologies.star import Star
from fedweave.transports.base import Transport

OBSERVERS = ("fedavg", "fedprox")
"""Strategies whose server step is the plain example-weighted mean: a ring's observer."""


def arrange(config: Config, link: Transport, strategy_cls: type) -> Topology:
    """The topology of ``config`` whose clients answer over ``link`` (one process: simulation)."""
    kind = config.topology.kind
    if kind == "star":
        return Star(link)
    if kind == "hierarchical":
        tree = site_tree(config.topology.sites, config.clients)  # type: ignore[arg-type]
        return Hierarchical(tree, link, exact_pre_aggregation(config, strategy_cls))
    if config.strategy.name not in OBSERVERS or config.aggregation.rule != "mean":
        raise ConfigError(
            "config key 'topology.kind': ring gossip needs a plain weighted-mean server to observe the "
            f"nodes' consensus ({', '.join(OBSERVERS)} with aggregation.rule mean); got strategy "
            f"{config.strategy.name!r} with aggregation.rule {config.aggregation.rule!r}"
        )
    return Ring(link, config.clients, config.topology.gossip_steps)
