"""The server's job board: the job posted to each node, who waits for it, how it ends, and what
an exchange reports (:class:`~fedweave.transports.grpc.server.GrpcServerTransport` composes it).

Every method but :func:`exchange_of` runs with the server's lock held by the caller or takes it.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time

from fedweave.transports.base import Exchange
from fedweave.transports.grpc.jobs import Job, expected_shapes, payload_nbytes
from fedweave.types import Message

log = logging.getLogger("fedweave.transports.grpc.server")  # one server, one log to follow


class JobBoard:
    """At most one job per node; each node's own condition wakes only that node's pull, so
    posting or finishing one job wakes one thread, not every waiting pull."""

    def __init__(self, lock: threading.RLock, cond: threading.Condition):
        self._lock = lock
        self._cond = cond
        self.jobs: dict[int, Job] = {}
        self.posted: list[Job] = []  # jobs posted one by one (asynchronous aggregation), not yet collected
        self._wake: dict[int, threading.Condition] = {}
        self._epoch = secrets.token_hex(3)
        self._count = 0

    def wake_of(self, cid: int) -> threading.Condition:
        """Node ``cid``'s condition (on the server's lock, which the caller holds)."""
        wake = self._wake.get(cid)
        if wake is None:
            wake = self._wake[cid] = threading.Condition(self._lock)
        return wake

    def wake_all(self) -> None:
        """Wake every waiting pull (the server closes; lock held)."""
        for wake in self._wake.values():
            wake.notify_all()

    def new_job(self, msg: Message, deadline: float | None, timeout: float | None) -> Job:
        """Post ``msg`` as its node's job (the caller holds the lock); the node's pull wakes."""
        self._count += 1
        job_id = f"{self._epoch}-{self._count}"
        job = Job(job_id, msg.client_id, msg, expected_shapes(msg), deadline=deadline, timeout=timeout,
                  posted=time.monotonic())
        self.jobs[msg.client_id] = job
        self.wake_of(msg.client_id).notify_all()
        return job

    def close_job(
        self, job: Job, *, reply: Message | None = None, failed: str | None = None, received: int = 0
    ) -> None:
        with self._cond:
            if not job.open:
                return
            if reply is not None:
                job.state, job.reply, job.bytes_received = "done", reply, received
                job.answered = time.monotonic()
            else:
                job.state, job.reason = "failed", failed or "failed"
            self._cond.notify_all()

    def release(self, jobs: list[Job]) -> None:
        """Drop ended jobs (an open one fails as interrupted), so memory does not grow (lock held)."""
        for job in jobs:
            if job.open:
                self.close_job(job, failed="the exchange was interrupted")
            if self.jobs.get(job.client_id) is job:
                del self.jobs[job.client_id]


def exchange_of(jobs: list[Job], waited: float | None, role: str) -> Exchange:
    """What ended ``jobs`` add up to: replies in the order of the messages (as in simulation),
    failures with their reasons, bytes on the wire and of payload."""
    result = Exchange(waited=waited)
    for job in jobs:
        result.wire_bytes_sent += job.bytes_sent
        result.wire_bytes_received += job.bytes_received
        result.bytes_sent += payload_nbytes(job.message.body) if job.bytes_sent else 0
        result.bytes_received += payload_nbytes(job.reply.body) if job.reply is not None else 0
        if job.reply is not None:
            result.replies.append(job.reply)
            if job.answered is not None:
                result.elapsed[job.client_id] = job.answered - job.posted
        else:
            result.failures[job.client_id] = job.reason
            log.warning("round %d: %s %d failed: %s", job.message.round, role, job.client_id, job.reason)
    return result
