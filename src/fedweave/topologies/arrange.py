"""Arrange a run's clients into the configured topology over a transport to the clients."""

from __future__ import annotations

from fedweave.config import Config
from fedweave.topologies.base import Topology
from fedweave.topologies.hierarchical import (
    Hierarchical,
    exact_pre_aggregation,
    site_tree,
)
from fedweave.topologies.ring import Ring
from fedweave.topologies.star import Star
from fedweave.transports.base import Transport


def arrange(config: Config, link: Transport, strategy_cls: type) -> Topology:
    """The topology of ``config`` whose clients answer over ``link`` (one process: simulation);
    :mod:`fedweave.rules` checked at load that the strategy suits it (a ring's observer)."""
    kind = config.topology.kind
    if kind == "star":
        return Star(link)
    if kind == "hierarchical":
        tree = site_tree(config.topology.sites, config.clients)  # type: ignore[arg-type]
        return Hierarchical(tree, link, exact_pre_aggregation(config, strategy_cls))
    return Ring(link, config.clients, config.topology.gossip_steps)
