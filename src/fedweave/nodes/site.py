"""Site nodes (``fedweave site CONFIG --site S --rank R``) and the member ranks of one torch.distributed job.

Across institutions, a site leader (rank 0) is ONE gRPC node of the server for its whole site and
the torchdist leader of the site's own world; its members (ranks 1..k) serve their clients in
that world (:mod:`fedweave.topologies.deploy` has the topologies they serve). In one
torch.distributed job, :func:`run_members` serves every rank but the aggregating rank 0.
"""

from __future__ import annotations

import logging

from fedweave.build import build_chains, build_client_runtime, build_task, strategy_class
from fedweave.federated.client import ClientRuntime, ClientStateStore
from fedweave.config import Config
from fedweave.errors import ConfigError
from fedweave.liveness import heartbeat
from fedweave.topologies.deploy import site_handler, site_members, site_port, site_ranks
from fedweave.topologies.hierarchical import exact_pre_aggregation
from fedweave.transports.torchdist import Handler, Rendezvous, TorchDistLeader, TorchDistMember, World

log = logging.getLogger(__name__)


def run_site_leader(
    config: Config,
    site: int,
    address: str | None = None,
    port: int | None = None,
    token: str | None = None,
) -> int:
    """A site leader between a gRPC server and its site: ONE gRPC node (``site-<site>``) for the
    whole site, and the torchdist leader of the site's own world (rank 0 on ``port``, default
    :func:`~fedweave.topologies.deploy.site_port`). Its members' updates are pre-aggregated by a
    reduce where that is exact (:func:`~fedweave.topologies.hierarchical.exact_pre_aggregation`),
    else relayed. Returns the jobs answered."""
    from fedweave.transports.grpc.client import GrpcClient

    members = site_members(config, site)
    port = site_port(config, site) if port is None else port
    ranks = list(range(1 + len(members)))
    rdv = Rendezvous(config.torchdist.address or "127.0.0.1", port, 0, len(ranks))
    pre = exact_pre_aggregation(config, strategy_class(config))
    world = World(config.torchdist, rdv)
    try:
        (group,) = world.site_groups([ranks])
        leader = TorchDistLeader(world, group, ranks, members, pre)
        log.info("site %d: %d members, %s", site, len(members), "pre-aggregating" if pre else "relaying")
        client = GrpcClient(
            config.grpc, site, site_handler(leader, site), role="site", address=address, token=token, seed=config.seed
        )
        try:
            with heartbeat(config.grpc.heartbeat_interval):
                return client.run()
        finally:
            leader.close()
    finally:
        world.close()


def run_site_member(config: Config, site: int, rank: int, port: int | None = None) -> int:
    """Member ``rank`` of site ``site``'s own world: serve its client until the leader stops."""
    members = site_members(config, site)
    if not 1 <= rank <= len(members):
        raise ConfigError(f"--rank {rank} is not a member of site {site} (ranks 1..{len(members)})")
    port = site_port(config, site) if port is None else port
    ranks = list(range(1 + len(members)))
    rdv = Rendezvous(config.torchdist.address or "127.0.0.1", port, rank, len(ranks))
    runtime = _runtime(config)
    with heartbeat(config.grpc.heartbeat_interval):  # FEDWEAVE_HEARTBEAT's file, from the rendezvous on
        world = World(config.torchdist, rdv)
        try:
            (group,) = world.site_groups([ranks])
            return TorchDistMember(world, group, ranks, runtime.handle).serve()
        finally:
            world.close()


def run_members(configs: list[Config], rdv: Rendezvous) -> int:
    """Join one torch.distributed job's world as a member rank and serve one run per config, in
    order (the same world; a fresh client runtime and state per run), as
    :func:`fedweave.nodes.client.run_client` does over gRPC."""
    world = World(configs[0].torchdist, rdv)
    done = 0
    try:
        for config in configs:
            runtime = _runtime(config)
            log.info("rank %d serves client %d", rdv.rank, client_of_rank(config, rdv.rank))
            done += serve_member(config, world, runtime.handle)
    finally:
        world.close()
    return done


def serve_member(config: Config, world: World, handler: Handler) -> int:
    """Serve this rank's site with ``handler`` until rank 0 stops it; return the jobs answered."""
    layout = site_ranks(config)
    groups = world.site_groups([ranks for ranks, _ in layout])
    for group, (ranks, _) in zip(groups, layout):
        if world.rdv.rank in ranks:
            return TorchDistMember(world, group, ranks, handler).serve()
    raise ValueError(f"rank {world.rdv.rank} is in no site")


def client_of_rank(config: Config, rank: int) -> int:
    """The client id a member rank of one torch.distributed job serves."""
    for _, members in site_ranks(config):
        for cid, r in members.items():
            if r == rank:
                return cid
    raise ValueError(f"rank {rank} serves no client")


def _runtime(config: Config) -> ClientRuntime:
    """A site member's client runtime, with a state store of its own."""
    return build_client_runtime(config, build_task(config), build_chains(config), ClientStateStore())
