"""How the server reaches its clients: the one module that decides it from the config.

=================================================  ==============================================
config                                             the server's topology
=================================================  ==============================================
``transport: inmemory``, star                      an in-memory star (:func:`simulation_link`: clients one after
                                                   another, or in vectorised cohorts, ``simulation.cohort``)
... with emulated client speeds                    :func:`~fedweave.topologies.emulated.emulated_clients`
``transport: inmemory``, hierarchical or ring      :func:`arrange` over the in-memory link
``launcher: ray``                                  :func:`arrange` over a pool of Ray actors
``transport: grpc`` (the server's own process)     :func:`server_topology`: a gRPC star, or one node per
                                                   top-level site (:class:`~fedweave.topologies.deploy.SiteBatches`)
                                                   whose leader reaches its members over torch.distributed
=================================================  ==============================================

``launcher: process`` starts ``fedweave server`` (:mod:`fedweave.nodes.server`), whose process
decides as ``transport: grpc``; the launching process runs no round itself.

``topology.inner: torchdist`` with ``transport: inmemory`` is one torch.distributed job (torchrun):
its rank 0 joins the world and gives :func:`fedweave.runner.prepare` a
:class:`~fedweave.topologies.deploy.TorchDistHierarchy` as its topology, the other ranks serve
their clients (:func:`fedweave.nodes.site.run_members`). Asked to reach those clients itself
(``fedweave run``), this module refuses, naming the key: an in-memory run of that config would
ignore its links.
"""

from __future__ import annotations

import logging

from fedweave.build import data_admission, strategy_class
from fedweave.federated.client import ClientRuntime
from fedweave.config import Config
from fedweave.errors import ConfigError
from fedweave.launchers.local import launch_local
from fedweave.topologies.base import Topology
from fedweave.topologies.deploy import SiteBatches
from fedweave.topologies.emulated import emulated_clients
from fedweave.topologies.hierarchical import (
    Hierarchical,
    exact_pre_aggregation,
    site_tree,
)
from fedweave.topologies.ring import Ring
from fedweave.topologies.star import Star
from fedweave.transports.base import Transport

log = logging.getLogger(__name__)


def clients_topology(config: Config, runtime: ClientRuntime) -> Topology:
    """How this process reaches the clients of ``config``, whose local work ``runtime`` does where
    they run in this process: in memory, on Ray actors, or, as a gRPC server, over the network."""
    if config.transport.kind == "grpc" and config.launcher.kind == "local":
        return server_topology(config)
    topo = config.topology
    if config.transport.kind == "inmemory" and topo.kind == "hierarchical" and topo.inner == "torchdist":
        raise ConfigError(
            "config key 'topology.inner': torchdist sites are the processes of one torch.distributed job, whose "
            "rank 0 passes its topology to runner.prepare; in simulation set topology.inner: inmemory, across "
            "machines transport: grpc (fedweave site)"
        )
    if config.launcher.kind == "ray":  # the clients' local work on a pool of Ray actors
        from fedweave.launchers.ray import launch_ray

        return arrange(config, launch_ray(config, runtime), strategy_class(config))
    emulated = emulated_clients(config, runtime.handle)  # None unless client speeds are emulated (star only)
    if emulated is not None:
        if config.simulation.cohort != "off":
            log.info("simulation.cohort: clients train one after another: emulated client speeds (heterogeneity.*) "
                     "time each client alone")
        return emulated
    return arrange(config, simulation_link(config, runtime), strategy_class(config))


def simulation_link(config: Config, runtime: ClientRuntime) -> Transport:
    """The in-memory link to ``runtime``'s clients: one after another (``simulation.cohort: off``)
    or in vectorised cohorts (:mod:`fedweave.cohort`), in this process or, with
    ``simulation.workers`` above 1, in that many worker processes."""
    cohort, workers = config.simulation.cohort, config.simulation.workers
    if cohort == "off" and workers == 1:
        return launch_local(runtime).transport
    from fedweave.cohort.trainer import CohortTrainer
    from fedweave.cohort.transport import CohortTransport

    if workers > 1:
        from fedweave.cohort.workers import WorkerPool

        return CohortTransport(runtime, WorkerPool(config, runtime))
    return CohortTransport(runtime, CohortTrainer.of(runtime, config))


def server_topology(config: Config, listen: str | None = None) -> Star | SiteBatches:
    """The server's gRPC topology (it starts listening now): a star whose clients connect, or,
    for ``topology.kind: hierarchical``, one node per top-level site whose leader connects."""
    from fedweave.transports.grpc.server import GrpcServerTransport

    if config.topology.kind == "hierarchical":
        tree = site_tree(config.topology.sites, config.clients)  # type: ignore[arg-type]
        return SiteBatches(tree, GrpcServerTransport(config.grpc, len(tree), listen=listen, role="site"))
    return Star(GrpcServerTransport(config.grpc, config.clients, listen=listen, admit=data_admission(config)))


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
