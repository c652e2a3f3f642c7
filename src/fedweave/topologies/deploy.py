"""The topologies of hierarchical deployments whose sites talk torch.distributed (``topology.inner: torchdist``).

Across institutions (``transport: grpc``), each top-level site is its own torch.distributed
world led by a site leader (:func:`fedweave.nodes.site.run_site_leader`) that is ONE gRPC node
of the server: the server's :class:`SiteBatches` sends it one job per round (the global model
once, each member's instruction) and gets one answer back (the members' pre-aggregated update
where that is exact, else their updates relayed), which the leader's :func:`site_handler` makes.
A step of a plugin's own protocol (secure aggregation's key set-up and unmasking) is one job too:
each member's control message, scattered to that member alone, and their control answers
relayed (never combined). Every node derives the site tree from the same config.

In one torch.distributed job (torchrun), rank 0 is the aggregating process (it leads every
top-level site), then one rank per client in the order of the site tree (:func:`site_ranks`).
Each top-level site is one process group (rank 0 and its members). Rank 0's
:class:`TorchDistHierarchy` gives the loop a hierarchical topology whose site links are
:class:`~fedweave.transports.torchdist.TorchDistLeader`; every other rank serves its client
(:func:`fedweave.nodes.site.run_members`).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, cast

from fedweave.config import Config
from fedweave.conforms import Conforms
from fedweave.errors import ConfigError, TransportError
from fedweave.topologies.hierarchical import (
    Site,
    exact_pre_aggregation,
    leaves,
    site_tree,
    top_site_members,
)
from fedweave.transports.base import BreaksWhole, Exchange, KnowsAbsent, Transport
from fedweave.transports.serialization import SiteJob, SiteReply
from fedweave.transports.torchdist import Handler, TorchDistLeader, World
from fedweave.types import Message, Update

log = logging.getLogger(__name__)

_knows_absent = Conforms(KnowsAbsent)  # asked every round (fedweave.conforms)


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
    """The root's own link: in one torch.distributed job every client is a member of a site, reached
    through its site's leader, so the root never sends over it."""

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
            Site(list(members), link, False, f"site {i}", link_aggregates=True)
            for i, (link, (_, members)) in enumerate(zip(self.links, layout))
        ]
        self.root = Site(sites, _Unused(), False, "server")

    def exchange(self, messages: list[Message], timeout: float | None) -> Exchange:
        return self.root.exchange(messages, timeout)

    def site_members(self, client_id: int) -> frozenset[int]:
        return top_site_members(self.root, client_id)

    def absent(self, wait_for: int = 0) -> frozenset[int]:
        """The members of every site whose group is broken (its leader logged why): later rounds sample
        around them for the rest of the run, one world being joined once. Nothing to wait for."""
        return frozenset(cid for link in self.links if link.broken is not None for cid in link.members)

    def close(self) -> None:
        for link in self.links:
            link.close()
        if self.own_world:
            self.world.close()


# --------------------------------------------------------------------------- gRPC across, gloo inside


def site_port(config: Config, site: int) -> int:
    """Site ``site``'s own torch.distributed world listens on ``torchdist.port + site``."""
    base = config.torchdist.port if config.torchdist.port is not None else 29500
    return base + site


def site_members(config: Config, site: int) -> dict[int, int]:
    """Client id -> rank in site ``site``'s own world (the leader is rank 0)."""
    top = config.topology
    if top.kind != "hierarchical" or top.inner != "torchdist" or config.transport.kind != "grpc":
        raise ConfigError(
            f"config key 'topology.kind': `fedweave site` runs a site of a hierarchical topology with inner torchdist "
            f"over transport grpc; this config has topology {top.kind!r} over {config.transport.kind!r} (its clients "
            "are `fedweave client` nodes, or run inside `fedweave run`)"
        )
    tree = site_tree(top.sites, config.clients)  # type: ignore[arg-type]
    if not 0 <= site < len(tree):
        raise ConfigError(
            f"--site {site} is not a site of this config (sites: 0..{len(tree) - 1})"
        )
    return {cid: rank for rank, cid in enumerate(leaves(tree[site]), start=1)}


class SiteBatches:
    """The server's view of a hierarchy whose top-level sites are each ONE node of ``link``
    (addressed by site index; over gRPC, a site leader).

    Per exchange each site gets one :class:`~fedweave.transports.serialization.SiteJob`
    holding its members' messages (instructions, or control steps of a plugin's protocol;
    a tensor they share, the global model, travels once) and answers one
    :class:`~fedweave.transports.serialization.SiteReply`: its members' replies (updates,
    evaluations, control answers), or one pre-aggregated update standing for the members that answered, and
    each failed member's reason. A site that fails as a whole (lost, late, refused)
    fails each of its clients. Replies come back in the order of the messages. The members
    of a site whose leader the link knows is gone are gone too (:meth:`absent`): the server
    reaches them only through it. So are those of a site whose leader reported its group broken
    (over gRPC, until the leader registers again): the link knows the site by its index, so a
    site's report speaks for its own members alone.
    """

    def __init__(self, tree: list[Any], link: Transport):
        self.transport = link
        self.site_of = {cid: s for s, site in enumerate(tree) for cid in leaves(site)}
        self.sites = [frozenset(leaves(site)) for site in tree]

    def exchange(self, messages: list[Message], timeout: float | None) -> Exchange:
        result = Exchange()
        per_site: dict[int, list[Message]] = {}
        for m in messages:
            if m.client_id not in self.site_of:
                result.failures[m.client_id] = "the client is in no site of topology.sites"
                continue
            per_site.setdefault(self.site_of[m.client_id], []).append(m)
        if not per_site:
            return result
        rnd = messages[0].round
        jobs = [Message(rnd, s, SiteJob(msgs, timeout)) for s, msgs in sorted(per_site.items())]
        ex = self.transport.exchange(jobs, timeout)
        result.bytes_sent, result.bytes_received, result.waited = ex.bytes_sent, ex.bytes_received, ex.waited
        result.wire_bytes_sent, result.wire_bytes_received = ex.wire_bytes_sent, ex.wire_bytes_received
        for reply in ex.replies:
            assert isinstance(reply.body, SiteReply)  # the transport checked it against the job
            result.replies.extend(reply.body.messages)
            result.failures.update(reply.body.failures)
        for s, why in ex.failures.items():
            for m in per_site[s]:
                result.failures[m.client_id] = f"site {s}: {why}"
        order = {m.client_id: i for i, m in enumerate(messages)}
        result.replies.sort(key=lambda r: order.get(r.client_id, len(order)))
        return result

    def site_members(self, client_id: int) -> frozenset[int]:
        site = self.site_of.get(client_id)
        return frozenset({client_id}) if site is None else self.sites[site]

    def absent(self, wait_for: int = 0) -> frozenset[int]:
        """The clients of every site whose leader the link knows is gone or broken (none, for a link that cannot tell).
        With ``wait_for`` clients asked for, the link first waits (bounded) for enough sites that even the
        smallest of them would hold that many members."""
        sizes = sorted(len(members) for members in self.sites)
        sites = next((k for k in range(len(sizes) + 1) if sum(sizes[:k]) >= wait_for), len(sizes))
        gone = cast(KnowsAbsent, self.transport).absent(sites) if _knows_absent(self.transport) else frozenset()
        return frozenset(cid for s in gone if 0 <= s < len(self.sites) for cid in self.sites[s])

    def close(self) -> None:
        self.transport.close()


MEMBER_SHARE = 0.9
"""The share of the server's deadline a site leader gives its members; the rest is for the
site's answer to reach the server."""


def site_handler(leader: Transport, site: int) -> Handler:
    """A site leader's job handler: the members' messages go to ``leader`` (a
    :class:`TorchDistLeader`, which pre-aggregates when it was built to), their replies and
    failures come back as one :class:`SiteReply`, which says so when the site's group is broken
    (the server then samples around the site's members until its leader registers again)."""

    def handle(msg: Message) -> Message:
        job = msg.body
        if not isinstance(job, SiteJob):
            raise TransportError(f"site {site} got a {type(job).__name__}, not a site job")
        timeout = None if job.timeout is None else job.timeout * MEMBER_SHARE
        ex = leader.exchange(job.messages, timeout)
        answered = sum(r.body.clients if isinstance(r.body, Update) else 1 for r in ex.replies)
        kinds = Counter(type(r.body).__name__.lower() for r in ex.replies)
        log.info(
            "site %d, round %d: %d of %d members answered in %s",
            site, msg.round, answered, len(job.messages),
            ", ".join(f"{n} {kind}(s)" for kind, n in sorted(kinds.items())) or "nothing",
        )
        broken = leader.broken if isinstance(leader, BreaksWhole) else None
        return Message(msg.round, site, SiteReply(ex.replies, ex.failures, broken))

    return handle
