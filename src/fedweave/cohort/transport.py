"""The in-memory link of a simulation whose clients train in vectorised cohorts.

:class:`CohortTransport` answers a round's messages as :class:`~fedweave.transports.inmemory.InMemoryTransport`
does, in message order, but does the round's client work together: each message is opened by the
client runtime (:meth:`~fedweave.federated.client.ClientRuntime.open`: decoded, the client's state settled),
the work of all of them is done by a :class:`~fedweave.cohort.trainer.CohortTrainer` (training jobs in
cohorts), and each answer is closed by the runtime (its state kept pending, its update encoded). A
message that is not a training instruction (a plugin's control step, an evaluation) is answered by
``handler`` (the runtime's ``handle``) alone.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

from fedweave.federated.client import ClientRuntime, Opened
from fedweave.cohort.trainer import Done, Work
from fedweave.transports.base import Exchange
from fedweave.transports.inmemory import answered, failed
from fedweave.types import Message, TaskKind, messages_nbytes

log = logging.getLogger(__name__)


class DoesWork(Protocol):
    """What does the clients' work: a :class:`~fedweave.cohort.trainer.CohortTrainer` in this
    process, or a :class:`~fedweave.cohort.workers.WorkerPool`."""

    reason: str | None

    def work(self, batch: list[Work]) -> list[Done | Exception]: ...


class CohortTransport:
    """Serves ``runtime``'s clients in memory through ``trainer``."""

    def __init__(self, runtime: ClientRuntime, trainer: DoesWork):
        self.runtime = runtime
        self.trainer = trainer
        self.handler = runtime.handle  # what answers a message alone, as InMemoryTransport's

    @property
    def reason(self) -> str | None:
        """Why no client trains in a cohort (None: they do where they may)."""
        return self.trainer.reason

    def exchange(self, messages: list[Message], timeout: float | None) -> Exchange:
        result = Exchange()
        deadline = None if timeout is None else time.monotonic() + timeout
        replies: dict[int, Message] = {}
        opened: dict[int, Opened] = {}
        result.bytes_sent += messages_nbytes(messages)
        for i, msg in enumerate(messages):
            try:
                if getattr(msg.body, "task", None) is not TaskKind.TRAIN:
                    replies[i] = self.handler(msg)
                    continue
                step = self.runtime.open(msg)
                if isinstance(step, Message):
                    replies[i] = step
                    self.runtime.release(msg.client_id)
                else:
                    opened[i] = step
            except Exception as exc:  # one client's failure must not stop the round
                self.runtime.release(msg.client_id)
                failed(result, msg.client_id, msg.round, exc)
        store = self.runtime.store
        order = list(opened)
        done = self.trainer.work([(opened[i].client_id, opened[i].instruction, store.get(opened[i].client_id)) for i in order])
        for i, outcome in zip(order, done):
            o = opened[i]
            try:
                if isinstance(outcome, Exception):
                    raise outcome
                replies[i] = self.runtime.close(o, *outcome)
            except Exception as exc:
                failed(result, o.client_id, o.round, exc)
            finally:
                self.runtime.release(o.client_id)
        for i in sorted(replies):
            answered(result, replies[i], deadline)
        return result

    def close(self) -> None:
        """Stop the trainer's worker processes, if it has any."""
        close = getattr(self.trainer, "close", None)
        if close is not None:
            close()
