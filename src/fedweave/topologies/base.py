"""The topology protocol: the server's view of how its messages reach the clients.

A star forwards to one transport. A hierarchy (later) forwards to site leaders that
aggregate their members and answer as one update, so the server's loop is the same
for every topology.
"""

from __future__ import annotations

from typing import Protocol

from fedweave.transports.base import Exchange
from fedweave.types import Message


class Topology(Protocol):
    def exchange(self, messages: list[Message], timeout: float | None) -> Exchange: ...

    def close(self) -> None: ...
