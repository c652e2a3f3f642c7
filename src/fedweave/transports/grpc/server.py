"""The server side of the gRPC transport: a :class:`~fedweave.transports.base.Transport`.

``exchange`` posts one job per message and waits until each client has answered,
failed, gone silent or missed the round's deadline. Asynchronous aggregation uses the same
jobs one at a time: ``post`` gives a node its next job and returns, ``collect`` takes the
jobs that ended, as they end. Clients pull their job
(server-streaming, ~1 MiB frames) and push their reply (client-streaming, or one unary
call when it is one frame); a client
counts as lost when nothing (heartbeat, pull, push) has come from it for
``grpc.heartbeat_timeout`` seconds, so a long local training is never mistaken for a
dead client and a dead client never holds a round until its deadline. Jobs and
replies are dropped when their exchange returns, so memory does not grow with rounds.

The transport composes four parts on one lock: the job board (:mod:`.board`), the nodes and
their signs of life (:mod:`.heartbeats`), who is calling (:mod:`.auth`) and the RPC handlers
(:mod:`.servicer`).

With ``role="site"`` the nodes are the site leaders of a hierarchical deployment (top-level
site indices, each authenticated like a client with credentials of its own): each job is
a :class:`~fedweave.transports.serialization.SiteJob` and its reply must be a
:class:`~fedweave.transports.serialization.SiteReply` that accounts for every member. A site
leader whose reply says its site's group is broken is absent until it registers again (a
restarted site: a fresh group), as one silent past ``heartbeat_timeout`` is until heard from.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from fedweave.errors import TransportError
from fedweave.transports.base import Exchange
from fedweave.transports.grpc import protocol as p
from fedweave.transports.grpc.auth import Authenticator
from fedweave.transports.grpc.board import JobBoard, exchange_of
from fedweave.transports.grpc.health import Health
from fedweave.transports.grpc.heartbeats import Heartbeats, NodeRecord
from fedweave.transports.grpc.jobs import Job
from fedweave.transports.grpc.servicer import Servicer
from fedweave.types import Message

if TYPE_CHECKING:
    from fedweave.config import GrpcConfig

log = logging.getLogger(__name__)


class GrpcServerTransport:
    """Serves jobs to ``num_nodes`` clients (or site leaders, ``role="site"``) over gRPC;
    ``exchange`` / ``close`` as any transport. Messages are addressed by node id."""

    def __init__(
        self,
        settings: GrpcConfig,
        num_nodes: int,
        *,
        listen: str | None = None,
        role: str = "client",
        admit: Callable[[Any], str | None] | None = None,
    ):
        grpc = p.grpc_module()
        self.settings = settings
        self.num_nodes = num_nodes
        self.role = role
        # One lock; the server's condition wakes whoever waits for nodes (an exchange, a new
        # registration, the close), and each node's own condition (the board's) wakes only that node's pull.
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._board = JobBoard(self._lock, self._cond)
        self._nodes = Heartbeats(self._cond, num_nodes, settings.heartbeat_timeout)
        auth = Authenticator(grpc, settings, role, num_nodes, self._nodes, self._cond)
        self._servicer = Servicer(grpc, settings, role, cond=self._cond, board=self._board, nodes=self._nodes,
                                  auth=auth, closing=lambda: self._closing, admit=admit)
        self._closing = False
        self._closed = False
        self._joined = False  # the first exchange waits for clients to register
        # Each client holds at most one pull and one push; heartbeats and registrations are short.
        pool = ThreadPoolExecutor(max_workers=2 * num_nodes + 8, thread_name_prefix="fedweave-grpc")
        self._server = grpc.server(pool, handlers=[self._servicer.handler()], options=p.options(settings, server=True))
        self.address = self._listen(listen or settings.listen or settings.address)
        self.health = Health(grpc, self._server, settings.health_listen)
        self._server.start()
        self.health.serving()
        log.info("gRPC server listening on %s (tls: %s, tokens: %s)", self.address, settings.tls, settings.tokens)
        for warning in p.security_warnings(settings, server=True):
            log.warning(warning)

    def _listen(self, bind: str) -> str:
        """Bind the server to ``bind`` (TLS when configured); the address it listens on."""
        credentials = p.server_credentials(self.settings)
        try:
            port = (
                self._server.add_secure_port(bind, credentials)
                if credentials is not None
                else self._server.add_insecure_port(bind)
            )
        except RuntimeError as exc:
            raise TransportError(f"cannot listen on {bind}: {exc}") from None
        if not port:
            raise TransportError(f"cannot listen on {bind} (is the address in use?)")
        return f"{bind.rpartition(':')[0]}:{port}"

    @property
    def _jobs(self) -> dict[int, Job]:
        """Each node's open or unreleased job (the board's)."""
        return self._board.jobs

    @property
    def _clients(self) -> dict[int, NodeRecord]:
        """The registered nodes (the heartbeats')."""
        return self._nodes.nodes

    # ------------------------------------------------------------------ Transport

    def exchange(self, messages: list[Message], timeout: float | None) -> Exchange:
        if not messages:
            return Exchange()
        self._join()
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        with self._cond:
            jobs = [self._board.new_job(msg, deadline, timeout) for msg in messages]
            try:
                while True:
                    self._expire(jobs, time.monotonic())
                    if not any(job.open for job in jobs):
                        break
                    wait = 0.25 if deadline is None else min(0.25, deadline - time.monotonic())
                    self._cond.wait(max(wait, 0.0))
            finally:
                self._board.release(jobs)
        return exchange_of(jobs, time.monotonic() - start, self.role)

    def post(self, messages: list[Message], timeout: float | None) -> None:
        """Post each message as its node's job and return at once; :meth:`collect` takes the
        answers as they come (asynchronous aggregation). Each job has its own ``timeout``."""
        if not messages:
            return
        self._join()
        now = time.monotonic()
        with self._cond:
            deadline = None if timeout is None else now + timeout
            self._board.posted.extend(self._board.new_job(msg, deadline, timeout) for msg in messages)

    def collect(self, wait: float) -> Exchange:
        """The posted jobs that ended (answered, failed, lost, past their deadline), waiting up to
        ``wait`` s for the first; the others stay posted."""
        end = time.monotonic() + wait
        board = self._board
        with self._cond:
            while True:
                self._expire(board.posted, time.monotonic())
                ended = [job for job in board.posted if not job.open]
                remaining = end - time.monotonic()
                if ended or remaining <= 0 or not board.posted:
                    break
                self._cond.wait(min(0.25, remaining))
            board.posted = [job for job in board.posted if job.open]
            board.release(ended)
        return exchange_of(ended, None, self.role)

    def _join(self) -> None:
        """Before the first job: wait for the nodes to register (``grpc.join_timeout``)."""
        if not self._joined:
            self._joined = True
            joined = self.wait_for_clients(self.num_nodes, self.settings.join_timeout)
            log.info("%d of %d %ss registered before the first round", joined, self.num_nodes, self.role)
        if self._nodes.first_round is None:
            self._nodes.first_round = time.monotonic()

    def _expire(self, jobs: list[Job], now: float) -> None:
        """Fail the open jobs whose node has gone silent or whose deadline has passed (lock held)."""
        for job in jobs:
            if not job.open:
                continue
            # silent since its last sign of life, which may be rounds ago: a node
            # lost in an earlier round fails at once until it is heard from again
            silent, what = self._nodes.silence(job.client_id, now)
            if silent > self.settings.heartbeat_timeout:
                self._board.close_job(job, failed=f"lost: it has not {what} for {silent:.1f} s")
            elif job.deadline is not None and now >= job.deadline:
                self._board.close_job(job, failed=f"missed the round deadline ({job.timeout:g} s)")

    def wait_for_clients(self, count: int, timeout: float) -> int:
        """Wait until ``count`` nodes have registered (at most ``timeout`` s); return how many did."""
        return self._nodes.wait_for(count, timeout)

    def absent(self, wait_for: int = 0) -> frozenset[int]:
        """The nodes known to be gone: silent for more than heartbeat_timeout, as :meth:`_expire`
        judges a job's node (one never registered, since the first round began), or site leaders
        that reported their site's group broken. None before the first round; a silent node is
        present again once it registers or is heard from, a broken site once it registers. While
        fewer than ``wait_for`` nodes are present, it first waits for them to come back, at
        most ``grpc.join_timeout`` s: a round short of min_clients is otherwise skipped at
        once, and an outage of every client skipped all the rounds left in a moment."""
        deadline = time.monotonic() + self.settings.join_timeout
        with self._cond:
            gone = self._nodes.gone(time.monotonic())
            if self.num_nodes - len(gone) < wait_for and self.settings.join_timeout > 0:
                log.warning("%d of %d %ss are present, fewer than the %d a round needs; waiting up to %g s "
                            "(grpc.join_timeout) for the others to come back", self.num_nodes - len(gone),
                            self.num_nodes, self.role, wait_for, self.settings.join_timeout)
            while self.num_nodes - len(gone) < wait_for and not self._closing:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(min(0.25, remaining))
                gone = self._nodes.gone(time.monotonic())
            return gone

    def node_counts(self) -> tuple[int, int]:
        """(registered, alive) nodes, alive meaning heard from within heartbeat_timeout (for monitoring)."""
        return self._nodes.counts()

    def declared_examples(self) -> dict[int, int]:
        """The training examples each registered node declared, by its authenticated id."""
        return self._nodes.declared_examples()

    def close(self) -> None:
        """Tell every live client to stop (on its next pull or heartbeat), then stop serving."""
        with self._cond:
            if self._closed:
                return
            self._closing = True
            self._board.wake_all()
            s = self.settings
            deadline = time.monotonic() + s.poll_timeout + s.heartbeat_interval + 1.0
            while time.monotonic() < deadline:
                if not self._nodes.waiting_for_stop(time.monotonic()):
                    break
                self._cond.wait(0.1)
            self._closed = True
            self._board.jobs.clear()
        self.health.close()
        self._server.stop(grace=1.0).wait(timeout=5.0)
        log.info("gRPC server on %s stopped", self.address)
