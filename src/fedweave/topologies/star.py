"""The star topology: one server, every client linked to it by one transport."""

from __future__ import annotations

from fedweave.transports.base import Exchange, Transport
from fedweave.types import Message


class Star:
    """All clients answer the server directly over ``transport``."""

    def __init__(self, transport: Transport):
        self.transport = transport

    def exchange(self, messages: list[Message], timeout: float | None) -> Exchange:
        return self.transport.exchange(messages, timeout)

    def close(self) -> None:
        self.transport.close()
