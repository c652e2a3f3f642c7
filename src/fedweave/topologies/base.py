"""The topology protocol: the server's view of how its messages reach the clients.

A star forwards to one transport. A hierarchy (later) forwards to site leaders that
aggregate their members and answer as one update, so the server's loop is the same
for every topology.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from fedweave.transports.base import Exchange
from fedweave.types import Message


class Topology(Protocol):
    def exchange(self, messages: list[Message], timeout: float | None) -> Exchange: ...

    def close(self) -> None: ...


@runtime_checkable
class Relaying(Protocol):
    """A topology whose site leaders may answer one pre-aggregated update for several clients
    (:class:`~fedweave.types.Update` ``members``); in any other, each client speaks for itself."""

    def site_members(self, client_id: int) -> frozenset[int]:
        """The clients an update sent by ``client_id``'s site may stand for: its site's."""
        ...
