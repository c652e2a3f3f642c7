"""The local launcher: every client runs in this process (simulation).

Clients are trained one after another by one :class:`~fedweave.federated.client.ClientRuntime`
holding one model instance, so memory does not grow with the number of clients;
the state of stateful clients lives in a :class:`~fedweave.federated.client.ClientStateStore`.
"""

from __future__ import annotations

from fedweave.federated.client import ClientRuntime
from fedweave.topologies.star import Star
from fedweave.transports.inmemory import InMemoryTransport


def launch_local(runtime: ClientRuntime) -> Star:
    """A star whose clients are served in-process by ``runtime``."""
    return Star(InMemoryTransport(runtime.handle))
