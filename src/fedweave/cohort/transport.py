"""The in-memory link of a simulation whose clients train in vectorised cohorts.

:class:`CohortTransport` receives a round's messages as :class:`~fedweave.transports.inmemory.InMemoryTransport`
does, and answers each as the client runtime would, message by message: it opens every message
(:meth:`~fedweave.client.ClientRuntime.open`), trains the training jobs that may (:mod:`.eligibility`)
in groups (:func:`groups`: by their settings and step, largest first, at most ``cohort`` clients and
``cohort_memory`` bytes each) with :func:`~fedweave.cohort.vectorised.train_group`, makes each
client's update with its strategy's ``finish`` and closes it as the runtime does; evaluations and
the clients that may not train in a cohort are the runtime's own work, one after another. A
reason a client trains on its own is logged once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from fedweave.client import ClientRuntime, Opened
from fedweave.cohort.eligibility import job_reason, static_reason
from fedweave.cohort.vectorised import group_bytes, group_size, steps_of, train_group
from fedweave.training import ClientJob, LocalStep
from fedweave.transports.base import Exchange
from fedweave.types import Message, TaskKind, body_nbytes

log = logging.getLogger(__name__)


@dataclass
class Pending:
    """A training job waiting for its cohort."""

    index: int  # its message's place in the exchange
    opened: Opened
    job: ClientJob
    step: LocalStep


class CohortTransport:
    """Serves ``runtime``'s clients in memory, training cohorts of at most ``limit`` clients
    (None: as many as fit) within ``budget_bytes``."""

    def __init__(self, runtime: ClientRuntime, limit: int | None, budget_bytes: int):
        self.runtime = runtime
        self.handler = runtime.handle  # what answers a message alone, as InMemoryTransport's
        self.limit = limit
        self.budget = budget_bytes
        self.reason = static_reason(runtime.algorithm, runtime.model, runtime.loss_fn)
        self._told: set[str] = set()
        if self.reason is not None:
            self._tell(f"clients train one after another: {self.reason}")

    def exchange(self, messages: list[Message], timeout: float | None) -> Exchange:
        result = Exchange()
        deadline = None if timeout is None else time.monotonic() + timeout
        replies: dict[int, Message] = {}
        pending: list[Pending] = []
        for i, msg in enumerate(messages):
            result.bytes_sent += body_nbytes(msg.body)
            try:
                done = self._open(msg, i, pending)
            except Exception as exc:  # one client's failure must not stop the round
                self._failed(result, msg.client_id, msg.round, exc)
                continue
            if done is not None:
                replies[i] = done
        for group in groups(pending, self.limit, self.budget, self.runtime):
            self._train(group, replies, result)
        for i in sorted(replies):
            reply = replies[i]
            if deadline is not None and time.monotonic() > deadline:
                log.warning("client %d missed the round %d deadline; reply dropped", reply.client_id, reply.round)
                result.failures[reply.client_id] = "missed the round deadline"
                continue
            result.bytes_received += body_nbytes(reply.body)
            result.replies.append(reply)
        return result

    def _open(self, msg: Message, index: int, pending: list[Pending]) -> Message | None:
        """The reply to ``msg`` when the runtime answers it alone, else None (its job is pending)."""
        runtime = self.runtime
        if self.reason is not None or not _trains(msg):
            return self.handler(msg)
        queued = False
        try:
            opened = runtime.open(msg)
            if isinstance(opened, Message):
                return opened
            instruction = opened.instruction
            if instruction.task is TaskKind.TRAIN:
                job = runtime.job(opened.client_id, instruction, runtime.store.get(opened.client_id), load=False)
                why = job_reason(job)
                if why is None:
                    pending.append(Pending(index, opened, job, runtime.algorithm.local_step(job)))  # type: ignore[attr-defined]
                    queued = True
                    return None
                self._tell(f"client {opened.client_id} trains on its own: {why}")
            body, state = runtime.work(opened.client_id, instruction, runtime.store.get(opened.client_id))
            return runtime.close(opened, body, state)
        finally:
            if not queued:
                runtime.release(msg.client_id)

    def _train(self, group: list[Pending], replies: dict[int, Message], result: Exchange) -> None:
        runtime = self.runtime
        started = time.perf_counter()
        try:
            trained = train_group(runtime.model, runtime.loss_fn, [p.job for p in group], [p.step for p in group])
        except Exception as exc:
            for p in group:
                runtime.release(p.opened.client_id)
                self._failed(result, p.opened.client_id, p.opened.round, exc)
            return
        elapsed = time.perf_counter() - started
        total_steps = sum(r.steps for r in trained.results) or 1
        for p, res, delta in zip(group, trained.results, trained.deltas):
            cid = p.opened.client_id
            try:
                share = elapsed * res.steps / total_steps  # the group's compute time, by each client's steps
                update = runtime.algorithm.finish(p.job, res, delta)  # type: ignore[attr-defined]
                body, state = runtime.trained(p.job, p.opened.instruction, update, share)
                replies[p.index] = runtime.close(p.opened, body, state)
            except Exception as exc:
                self._failed(result, cid, p.opened.round, exc)
            finally:
                runtime.release(cid)

    def _failed(self, result: Exchange, cid: int, rnd: int, exc: Exception) -> None:
        log.warning("client %d failed in round %d: %s", cid, rnd, exc, exc_info=True)
        result.failures[cid] = f"{type(exc).__name__}: {exc}"

    def _tell(self, line: str) -> None:
        key = line.split(":", 1)[1] if line.startswith("client ") else line
        if key not in self._told:
            self._told.add(key)
            log.info("simulation.cohort: %s", line)

    def close(self) -> None:
        """Nothing to release."""


def _trains(msg: Message) -> bool:
    """Whether ``msg`` may be a training instruction (a control step or an evaluation is answered alone)."""
    return getattr(msg.body, "task", None) is TaskKind.TRAIN


def groups(pending: list[Pending], limit: int | None, budget: int, runtime: ClientRuntime) -> list[list[Pending]]:
    """``pending`` in cohorts: clients with the same settings and the same kind of step together,
    the most steps first (so that the clients of a group stop at nearly the same step), each group
    at most ``limit`` clients and ``budget`` bytes."""
    by_kind: dict[tuple, list[Pending]] = {}
    for p in pending:
        step = p.step
        kind = (p.job.settings, step.penalty, step.correction is not None)
        by_kind.setdefault(kind, []).append(p)
    out = []
    for members in by_kind.values():
        members.sort(key=lambda p: -steps_of(p.job))
        batch = max(min(p.job.instruction.work.batch_size, p.job.x_train.shape[0]) for p in members)
        size = group_size(limit, budget, group_bytes(runtime.model, members[0].job.x_train[0], batch))
        out.extend(members[i : i + size] for i in range(0, len(members), size))
    return out
