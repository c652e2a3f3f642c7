"""The transport protocol: send each message to its client, collect the replies.

A transport never raises for one client's failure: a client that errors, times out
or sends something malformed is reported in ``Exchange.failures`` and the round goes
on with the others.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from fedweave.types import Message


@dataclass
class Exchange:
    """What came back from one exchange."""

    replies: list[Message] = field(default_factory=list)
    failures: dict[int, str] = field(default_factory=dict)  # client id -> reason
    bytes_sent: int = 0  # payload: the tensor data the messages carry (types.body_nbytes), in every transport
    bytes_received: int = 0
    wire_bytes_sent: int = 0  # what crossed a network as serialized frames (gRPC); 0 where nothing did
    wire_bytes_received: int = 0
    waited: float | None = None
    """Seconds the exchange waited on the real clock, where the transport measures it (a networked
    server); None where a simulation's clock judges the round (the deadline stands for the wait)."""
    elapsed: dict[int, float] = field(default_factory=dict)
    """Per answering node, seconds from its job's post to its reply, where the transport measures
    them (a networked server; :mod:`fedweave.deadlines` sets the next jobs' deadline from them)."""


class Transport(Protocol):
    def exchange(self, messages: list[Message], timeout: float | None) -> Exchange: ...

    def close(self) -> None: ...


@runtime_checkable
class KnowsAbsent(Protocol):
    """A transport that knows which of its nodes are gone (a networked server: silent past its
    heartbeat timeout, or a site leader that reported its site's group broken), so that rounds
    sample the others until they are back (heard from again; a broken site's leader: registered
    again); with ``wait_for``, it first waits a bounded time for that many to be present."""

    def absent(self, wait_for: int = 0) -> frozenset[int]: ...


@runtime_checkable
class KnowsDeclared(Protocol):
    """A transport whose nodes declared their training examples when they registered (a gRPC
    server whose clients read their own data), by authenticated id: no claim of a node may
    count more than its declaration (:meth:`fedweave.federated.checks.WeightPolicy.bound`)."""

    def declared_examples(self) -> Mapping[int, int]: ...


@runtime_checkable
class BreaksWhole(Protocol):
    """A transport that fails as a whole (a site's torch.distributed group, once a collective failed):
    ``broken`` says why, and from then on it reaches none of its nodes."""

    broken: str | None


@runtime_checkable
class PostsJobs(Protocol):
    """A transport that also gives one node a job at a time and takes the answers as they come
    (asynchronous aggregation over a network: :func:`fedweave.federated.buffered.run_deployed`)."""

    def post(self, messages: list[Message], timeout: float | None) -> None: ...

    def collect(self, wait: float) -> Exchange: ...
