"""Hierarchical deployments whose sites talk torch.distributed (``topology.inner: torchdist``).

Ranks of the world: 0 is the aggregating process (it leads every top-level site), then one
rank per client in the order of the site tree. Each top-level site is one process group
(rank 0 and its members). On rank 0, :func:`torchdist_topology` gives the loop a
hierarchical topology whose site links are :class:`~fedweave.transports.torchdist.TorchDistLeader`;
every other rank runs :func:`serve_member` with a client runtime built from the same config.
"""

from __future__ import annotations

import logging
import threading
import time

from fedweave.config import Config
from fedweave.errors import ConfigError
from fedweave.topologies.hierarchical import (
    Site,
    exact_pre_aggregation,
    leaves,
    site_tree,
)
from fedweave.transports.base import Exchange
from fedweave.transports.torchdist import (
    Handler,
    Rendezvous,
    TorchDistLeader,
    TorchDistMember,
    World,
)
from fedweave.types import Message

log = logging.getLogger(__name__)


def site_ranks(config: Config) -> list[tuple[list[int], dict[int, int]]]:
    """Per top-level site: its group's ranks (leader 0 first) and client id -> rank."""
    tree = site_tree(config.topology.sites, config.clients)  # type: ignore[arg-type]
    out, rank = [], 1
    for site in tree:
        members = {}
        for cid in leaves(site):
            members[cid] = rank
            rank += 1
        out.append(([0, *members.values()], members))
    return out


def world_size(config: Config) -> int:
    return 1 + config.clients


class _Unused:
    def exchange(self, messages: list[Message], timeout: float | None) -> Exchange:
        raise AssertionError("every client of a torchdist hierarchy belongs to a site")

    def close(self) -> None:
        """Nothing to release."""


class TorchDistHierarchy:
    """Rank 0's topology: each top-level site is reached over its own process group."""

    def __init__(
        self, config: Config, world: World, strategy_cls: type, own_world: bool = True
    ):
        self.world = world
        self.own_world = own_world
        layout = site_ranks(config)
        groups = world.site_groups([ranks for ranks, _ in layout])
        pre = exact_pre_aggregation(config, strategy_cls)
        self.links = [
            TorchDistLeader(world, g, ranks, members, pre)
            for g, (ranks, members) in zip(groups, layout)
        ]
        sites = [
            Site(list(members), link, False, f"site {i}")
            for i, (link, (_, members)) in enumerate(zip(self.links, layout))
        ]
        self.root = Site(sites, _Unused(), False, "server")

    def exchange(self, messages: list[Message], timeout: float | None) -> Exchange:
        return self.root.exchange(messages, timeout)

    def close(self) -> None:
        for link in self.links:
            link.close()
        if self.own_world:
            self.world.close()


def torchdist_topology(
    config: Config, rdv: Rendezvous, strategy_cls: type
) -> TorchDistHierarchy:
    """Join the world as rank 0 and lead every top-level site."""
    return TorchDistHierarchy(config, World(config.torchdist, rdv), strategy_cls)


def serve_member(config: Config, world: World, handler: Handler) -> int:
    """Serve this rank's site with ``handler`` until rank 0 stops it; return the jobs answered."""
    layout = site_ranks(config)
    groups = world.site_groups([ranks for ranks, _ in layout])
    for group, (ranks, _) in zip(groups, layout):
        if world.rdv.rank in ranks:
            return TorchDistMember(world, group, ranks, handler).serve()
    raise ValueError(f"rank {world.rdv.rank} is in no site")


def run_members(configs: list[Config], rdv: Rendezvous) -> int:
    """Join the world as a member rank and serve one run per config, in order (the same
    world; a fresh client runtime and state per run), as :func:`fedweave.node.run_client` does over gRPC."""
    from fedweave.build import build_chains, build_client_runtime, build_task
    from fedweave.client import ClientStateStore

    world = World(configs[0].torchdist, rdv)
    done = 0
    try:
        for config in configs:
            task = build_task(config)
            runtime = build_client_runtime(
                config, task, build_chains(config), ClientStateStore()
            )
            log.info(
                "rank %d serves client %d", rdv.rank, client_of_rank(config, rdv.rank)
            )
            done += serve_member(config, world, runtime.handle)
    finally:
        world.close()
    return done


def client_of_rank(config: Config, rank: int) -> int:
    """The client id a member rank serves."""
    for _, members in site_ranks(config):
        for cid, r in members.items():
            if r == rank:
                return cid
    raise ValueError(f"rank {rank} serves no client")


# --------------------------------------------------------------------------- gRPC across, gloo inside


def site_port(config: Config, site: int) -> int:
    """Site ``site``'s own torch.distributed world listens on ``torchdist.port + site``."""
    base = config.torchdist.port if config.torchdist.port is not None else 29500
    return base + site


def site_members(config: Config, site: int) -> dict[int, int]:
    """Client id -> rank in site ``site``'s own world (the leader is rank 0)."""
    tree = site_tree(config.topology.sites, config.clients)  # type: ignore[arg-type]
    if not 0 <= site < len(tree):
        raise ConfigError(
            f"--site {site} is not a site of this config (sites: 0..{len(tree) - 1})"
        )
    return {cid: rank for rank, cid in enumerate(leaves(tree[site]), start=1)}


class _Batcher:
    """Turns the gRPC clients' one-job calls into one site exchange per round.

    Each member id has its own gRPC client thread; a job waits up to ``window`` seconds
    for the site's other jobs of the round, so the members train in parallel.
    """

    def __init__(self, leader: TorchDistLeader, ids: list[int], window: float = 0.2):
        self.leader = leader
        self.ids = set(ids)
        self.window = window
        self.cond = threading.Condition()
        self.pending: dict[int, Message] = {}
        self.done: dict[int, Message | str] = {}
        self.busy = False

    def handle(self, msg: Message) -> Message:
        with self.cond:
            self.pending[msg.client_id] = msg
            self.cond.notify_all()
            deadline = time.monotonic() + self.window
            while msg.client_id not in self.done:
                if not self.busy and (
                    set(self.pending) >= self.ids or time.monotonic() >= deadline
                ):
                    self._run()  # this thread runs the exchange for everyone pending
                    continue
                self.cond.wait(timeout=max(0.01, deadline - time.monotonic()))
            result = self.done.pop(msg.client_id)
        if isinstance(result, str):
            raise RuntimeError(result)
        return result

    def _run(self) -> None:
        batch = [self.pending.pop(c) for c in sorted(self.pending)]
        self.busy = True
        self.cond.release()
        try:
            ex = self.leader.exchange(batch, None)
        finally:
            self.cond.acquire()
            self.busy = False
        for reply in ex.replies:
            self.done[reply.client_id] = reply
        for m in batch:
            self.done.setdefault(
                m.client_id, ex.failures.get(m.client_id, "no reply from the site")
            )
        self.cond.notify_all()


def run_site_leader(
    config: Config, site: int, address: str | None = None, port: int | None = None
) -> int:
    """A site leader between a gRPC server and its site: a gRPC client for each member id
    (relaying each member's update unchanged, so any strategy works) and the torchdist
    leader of the site's own world (rank 0 on ``port``, default :func:`site_port`). Returns the jobs answered."""
    from fedweave.transports.grpc.client import GrpcClient

    members = site_members(config, site)
    port = site_port(config, site) if port is None else port
    rdv = Rendezvous(config.torchdist.address or "127.0.0.1", port, 0, 1 + len(members))
    world = World(config.torchdist, rdv)
    try:
        (group,) = world.site_groups([list(range(1 + len(members)))])
        leader = TorchDistLeader(world, group, list(range(1 + len(members))), members)
        batcher = _Batcher(leader, list(members))
        clients = [
            GrpcClient(
                config.grpc, cid, batcher.handle, address=address, seed=config.seed
            )
            for cid in members
        ]
        counts: list[int] = []
        threads = [
            threading.Thread(
                target=lambda c=c: counts.append(c.run()),
                name=f"site-{site}-client-{c.client_id}",
            )
            for c in clients
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        leader.close()
        return sum(counts)
    finally:
        world.close()


def run_site_member(
    config: Config, site: int, rank: int, port: int | None = None
) -> int:
    """Member ``rank`` of site ``site``'s own world: serve its client until the leader stops."""
    from fedweave.build import build_chains, build_client_runtime, build_task
    from fedweave.client import ClientStateStore

    members = site_members(config, site)
    if not 1 <= rank <= len(members):
        raise ConfigError(
            f"--rank {rank} is not a member of site {site} (ranks 1..{len(members)})"
        )
    port = site_port(config, site) if port is None else port
    rdv = Rendezvous(
        config.torchdist.address or "127.0.0.1", port, rank, 1 + len(members)
    )
    task = build_task(config)
    runtime = build_client_runtime(
        config, task, build_chains(config), ClientStateStore()
    )
    world = World(config.torchdist, rdv)
    try:
        (group,) = world.site_groups([list(range(1 + len(members)))])
        return TorchDistMember(
            world, group, list(range(1 + len(members))), runtime.handle
        ).serve()
    finally:
        world.close()
