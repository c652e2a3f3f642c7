"""The hierarchical topology: site leaders aggregate their members and answer the level above.

A site is a list of members; a member is a client id or a site, so the tree has any
depth. A site leader forwards each member's instruction over its link (in simulation
the in-memory transport; in a deployment a torch.distributed group), collects the
replies, and answers its parent:

- **pre-aggregated** when that is exact: the strategy's server step needs only the
  example-weighted sum of the updates (``weighted_sum``), the aggregation rule is the
  mean, no server-side plugin must see each update (a DP-SGD ledger observes each
  client's report), and the updates arrive in the clear.
  The site answers one update, the weighted mean of its members' tensors with the sum of
  their examples as its weight, naming its members (so the server tells each of them
  whether their update was applied). Since Σ_s N_s · (Σ_{k∈s} n_k x_k / N_s) / Σ_s N_s =
  Σ_k n_k x_k / Σ_k n_k, a tree of such sites gives the server exactly the flat weighted
  average, at every depth.
- **relayed** otherwise (SCAFFOLD's control variates, FedDyn, FedNova, robust rules,
  encoded updates, evaluations): every member's reply goes up unchanged, so the server
  step is the same as in a star.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fedweave.plugins import PLUGINS
from fedweave.plugins.contracts import POINTS
from fedweave.strategies.aggregate import weighted_average
from fedweave.transports.base import Exchange, Transport
from fedweave.types import Message, Update, body_nbytes, messages_nbytes
from fedweave.federated.checks import Rejected, check_senders

log = logging.getLogger(__name__)

Tree = int | list["Tree"]


def site_tree(sites: int | list[Any], clients: int) -> list[Any]:
    """The sites of a config: ``N`` splits ids 0..clients-1 into N contiguous sites."""
    if isinstance(sites, int):
        bounds = [round(i * clients / sites) for i in range(sites + 1)]
        return [list(range(bounds[i], bounds[i + 1])) for i in range(sites)]
    return sites


def leaves(tree: Tree) -> list[int]:
    """The client ids below ``tree``, in order."""
    if isinstance(tree, int):
        return [tree]
    return [cid for child in tree for cid in leaves(child)]


def combinable(updates: Sequence[Update]) -> bool:
    """Whether a weighted mean of ``updates`` is exact: same kind and tensors (names, shapes,
    dtypes), in the clear, no extras. Otherwise each is relayed, for the server to check."""
    if len(updates) < 2:
        return False
    kind, first = updates[0].kind, updates[0].tensors
    return all(
        u.kind == kind
        and u.tensors.keys() == first.keys()
        and all(t.shape == first[k].shape and t.dtype == first[k].dtype for k, t in u.tensors.items())
        and not u.applied
        and not u.extras
        for u in updates
    )


def combine(updates: Sequence[Update], client_id: int) -> Update:
    """One update standing for ``updates``: their example-weighted mean, weighing the sum of examples."""
    weights = [u.num_examples for u in updates]
    total = sum(weights)
    names = set.intersection(*(set(u.metrics) for u in updates))
    return Update(
        kind=updates[0].kind,
        tensors=weighted_average([u.tensors for u in updates], weights),
        num_examples=total,
        metrics={
            m: sum(u.metrics[m] * u.num_examples for u in updates) / total
            for m in sorted(names)
        },
        client_id=client_id,
        local_steps=max(u.local_steps for u in updates),
        compute_time=max(u.compute_time for u in updates),
        clients=sum(u.clients for u in updates),
        members=[cid for u in updates for cid in u.senders],  # whose update the server applies
    )


class Site:
    """A site leader over ``members`` (client ids reached over ``link``, or child sites).

    A member client's reply speaks for that client alone, unless ``link_aggregates``: the
    link is itself a leader that may pre-aggregate the site's member clients (a
    torch.distributed reduce), whose update then stands for some of them, each once."""

    def __init__(
        self,
        members: Sequence[int | Site],
        link: Transport,
        pre_aggregate: bool,
        name: str = "site",
        link_aggregates: bool = False,
    ):
        self.members = list(members)
        self.link = link
        self.pre_aggregate = pre_aggregate
        self.name = name
        self.link_aggregates = link_aggregates
        self.ids: list[int] = [
            cid for m in self.members for cid in ([m] if isinstance(m, int) else m.ids)
        ]

    def exchange(self, messages: list[Message], timeout: float | None) -> Exchange:
        """Forward each member's messages, collect the replies, pre-aggregate them when exact."""
        result = self._collect(messages, timeout)
        direct = {m for m in self.members if isinstance(m, int)}
        counted: set[int] = set()
        for reply in list(result.replies):  # a client speaks for itself; a child site or leader for its members
            if reply.client_id not in direct or not isinstance(reply.body, Update):
                continue
            try:
                may = direct if self.link_aggregates else {reply.client_id}
                counted.update(check_senders(reply.body, reply.client_id, may, counted))
            except Rejected as exc:
                result.replies.remove(reply)
                result.failures[reply.client_id] = f"rejected: {exc}"
        updates = [r.body for r in result.replies if isinstance(r.body, Update)]
        if (
            self.pre_aggregate
            and len(updates) == len(result.replies)  # every reply is an update
            and combinable(updates)
        ):
            first = result.replies[0]
            combined = combine(updates, first.client_id)
            log.debug("%s: %d updates pre-aggregated", self.name, len(updates))
            result.replies = [Message(first.round, first.client_id, combined)]
            result.bytes_received = body_nbytes(combined)
        return result

    def _collect(self, messages: list[Message], timeout: float | None) -> Exchange:
        result = Exchange()
        direct = {m for m in self.members if isinstance(m, int)}
        to_link = [m for m in messages if m.client_id in direct]
        parts: list[tuple[list[Message], Exchange]] = []
        if to_link:
            parts.append((to_link, self.link.exchange(to_link, timeout)))
        for child in self.members:
            if isinstance(child, Site):
                mine = [m for m in messages if m.client_id in set(child.ids)]
                if mine:
                    parts.append((mine, child.exchange(mine, timeout)))
        order = {m.client_id: i for i, m in enumerate(messages)}
        for sent, ex in parts:
            result.replies.extend(ex.replies)
            result.failures.update(ex.failures)
            result.bytes_sent += messages_nbytes(sent)
            result.bytes_received += sum(body_nbytes(r.body) for r in ex.replies)
        result.replies.sort(key=lambda r: order.get(r.client_id, len(order)))
        return result

    def close(self) -> None:
        self.link.close()
        for child in self.members:
            if isinstance(child, Site):
                child.close()


class Hierarchical:
    """The server's view: its direct children are the top-level sites; their answers are not combined again."""

    def __init__(self, tree: list[Any], link: Transport, pre_aggregate: bool):
        self.root = Site(
            [
                _build(child, link, pre_aggregate, f"site {i}")
                for i, child in enumerate(tree)
            ],
            link,
            False,
            "server",
        )
        self.pre_aggregate = pre_aggregate

    def exchange(self, messages: list[Message], timeout: float | None) -> Exchange:
        return self.root.exchange(messages, timeout)

    def site_members(self, client_id: int) -> frozenset[int]:
        return top_site_members(self.root, client_id)

    def close(self) -> None:
        self.root.link.close()


def top_site_members(root: Site, client_id: int) -> frozenset[int]:
    """The clients of the top-level site of ``root`` that holds ``client_id`` (itself alone
    when it answers the root directly): those one update from that site may stand for."""
    for child in root.members:
        if isinstance(child, Site) and client_id in child.ids:
            return frozenset(child.ids)
    return frozenset({client_id})


def _build(tree: Tree, link: Transport, pre_aggregate: bool, name: str) -> int | Site:
    if isinstance(tree, int):
        return tree
    return Site(
        [_build(c, link, pre_aggregate, f"{name}.{i}") for i, c in enumerate(tree)],
        link,
        pre_aggregate,
        name,
    )


def exact_pre_aggregation(config: Any, strategy_cls: type) -> bool:
    """Whether site leaders may answer with their members' weighted mean for this run (see the module doc)."""
    return (
        config.topology.pre_aggregate == "auto"
        and bool(getattr(strategy_cls, "weighted_sum", False))
        and config.aggregation.rule == "mean"
        and not config.plugins.server_receive
        and not config.plugins.client_send
        and not any(
            hasattr(PLUGINS.get(spec.name, "plugins"), "observe") for point in POINTS for spec in getattr(config.plugins, point)
        )
    )
