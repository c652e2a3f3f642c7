"""The in-memory transport: clients are functions in this process (simulation)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from fedweave.transports.base import Exchange
from fedweave.types import Message, body_nbytes, messages_nbytes

log = logging.getLogger(__name__)

Handler = Callable[[Message], Message]


class InMemoryTransport:
    """Hands each message to ``handler`` (the client runtime) and returns its reply.

    Clients run one after another. Bytes are counted as a dense wire format would
    carry the tensors. With a timeout, a reply that arrives after the round's deadline
    counts as a straggler and is dropped, as a networked server would drop it.
    """

    def __init__(self, handler: Handler):
        self.handler = handler

    def exchange(self, messages: list[Message], timeout: float | None) -> Exchange:
        result = Exchange()
        deadline = None if timeout is None else time.monotonic() + timeout
        result.bytes_sent += messages_nbytes(messages)
        for msg in messages:
            try:
                reply = self.handler(msg)
            except Exception as exc:  # one client's failure must not stop the round
                failed(result, msg.client_id, msg.round, exc)
                continue
            answered(result, reply, deadline)
        return result

    def close(self) -> None:
        """Nothing to release."""


def failed(result: Exchange, cid: int, rnd: int, exc: BaseException) -> None:
    """Count client ``cid``'s failure in round ``rnd`` in ``result``, logged."""
    log.warning("client %d failed in round %d: %s", cid, rnd, exc, exc_info=exc)
    result.failures[cid] = f"{type(exc).__name__}: {exc}"


def answered(result: Exchange, reply: Message, deadline: float | None) -> None:
    """Take ``reply`` into ``result``, or drop it as a straggler when it comes after ``deadline``
    (``time.monotonic()`` seconds), as a networked server would."""
    if deadline is not None and time.monotonic() > deadline:
        log.warning("client %d missed the round %d deadline; reply dropped", reply.client_id, reply.round)
        result.failures[reply.client_id] = "missed the round deadline"
        return
    result.bytes_received += body_nbytes(reply.body)
    result.replies.append(reply)
