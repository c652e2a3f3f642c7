"""The server's nodes: who registered, when each was last heard from, and so who is gone
(:class:`~fedweave.transports.grpc.server.GrpcServerTransport` composes it).

A node counts as lost when nothing (heartbeat, pull, push) has come from it for
``grpc.heartbeat_timeout`` seconds; one never registered, since the first round began. A site
leader whose reply says its site's group is broken is absent until it registers again.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

log = logging.getLogger("fedweave.transports.grpc.server")  # one server, one log to follow


@dataclass
class NodeRecord:
    session: str
    peer: str
    last_seen: float
    told_to_stop: bool = False
    broken: str | None = None  # a site leader's report that its site's group is broken, for this session
    examples: int | None = None  # the training examples it declared at registration, if it did


class Heartbeats:
    """The registered nodes of one server and the signs of life they give (on the server's lock)."""

    def __init__(self, cond: threading.Condition, num_nodes: int, heartbeat_timeout: float):
        self._cond = cond
        self.num_nodes = num_nodes
        self.timeout = heartbeat_timeout
        self.nodes: dict[int, NodeRecord] = {}
        self.first_round: float | None = None  # when it began: an unregistered node is silent since then

    def alive(self, cid: int) -> None:
        """Node ``cid`` gave a sign of life (lock held)."""
        node = self.nodes.get(cid)
        if node is not None:
            node.last_seen = time.monotonic()

    def silence(self, cid: int, now: float) -> tuple[float, str]:
        """How long node ``cid`` has been silent at ``now`` and the sign of life it has not given:
        since its last one, which may be rounds ago, or since the first round if it never registered."""
        node = self.nodes.get(cid)
        seen = node.last_seen if node is not None else self.first_round or now
        return now - seen, "registered" if node is None else "sent a heartbeat"

    def gone(self, now: float) -> frozenset[int]:
        """The nodes silent past heartbeat_timeout at ``now``, and the broken sites (lock held)."""
        if self.first_round is None:
            return frozenset()
        seen = {cid: self.first_round for cid in range(self.num_nodes)}
        seen.update((cid, c.last_seen) for cid, c in self.nodes.items())
        broken = {cid for cid, c in self.nodes.items() if c.broken is not None}
        return frozenset(cid for cid, t in seen.items() if now - t > self.timeout or cid in broken)

    def counts(self) -> tuple[int, int]:
        """(registered, alive) nodes, alive meaning heard from within heartbeat_timeout."""
        now = time.monotonic()
        with self._cond:
            seen = [c.last_seen for c in self.nodes.values()]
        return len(seen), sum(now - t <= self.timeout for t in seen)

    def wait_for(self, count: int, timeout: float) -> int:
        """Wait until ``count`` nodes have registered (at most ``timeout`` s); return how many did."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self.nodes) < count and time.monotonic() < deadline:
                self._cond.wait(min(0.25, max(deadline - time.monotonic(), 0.0)))
            return len(self.nodes)

    def waiting_for_stop(self, now: float) -> list[NodeRecord]:
        """The live nodes not yet told to stop (lock held)."""
        return [c for c in self.nodes.values() if not c.told_to_stop and now - c.last_seen <= self.timeout]

    def mark_broken(self, cid: int, session: str | None, reason: str) -> None:
        """Site ``cid`` reports its group broken: absent until it registers again (a new session)."""
        with self._cond:
            node = self.nodes.get(cid)
            if node is None or node.session != session or node.broken is not None:
                return  # registered again meanwhile (a restarted site), or already known
            node.broken = reason[:500]
        log.warning(
            "site %d reports its group broken (%s): later rounds sample around its members until it registers again",
            cid, node.broken,
        )

    def declared_examples(self) -> dict[int, int]:
        """The training examples each registered node declared, by its authenticated id."""
        with self._cond:
            return {cid: c.examples for cid, c in self.nodes.items() if c.examples is not None}
