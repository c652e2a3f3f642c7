"""The star topology: one server, every client linked to it by one transport."""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

from fedweave.conforms import Conforms
from fedweave.transports.base import Exchange, KnowsAbsent, KnowsDeclared, Transport
from fedweave.types import Message

_knows_absent = Conforms(KnowsAbsent)
_knows_declared = Conforms(KnowsDeclared)


class Star:
    """All clients answer the server directly over ``transport``."""

    def __init__(self, transport: Transport):
        self.transport = transport

    def exchange(self, messages: list[Message], timeout: float | None) -> Exchange:
        return self.transport.exchange(messages, timeout)

    def absent(self, wait_for: int = 0) -> frozenset[int]:
        """The clients its transport knows are gone (none, for a transport that cannot tell); with
        ``wait_for``, after waiting a bounded time for that many to be present."""
        return cast(KnowsAbsent, self.transport).absent(wait_for) if _knows_absent(self.transport) else frozenset()

    def declared_examples(self) -> Mapping[int, int]:
        """The examples each client declared at registration (none, for a transport without declarations)."""
        return cast(KnowsDeclared, self.transport).declared_examples() if _knows_declared(self.transport) else {}

    def close(self) -> None:
        self.transport.close()
