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

With ``role="site"`` the nodes are the site leaders of a hierarchical deployment (top-level
site indices, each authenticated like a client with credentials of its own): each job is
a :class:`~fedweave.transports.serialization.SiteJob` and its reply must be a
:class:`~fedweave.transports.serialization.SiteReply` that accounts for every member. A site
leader whose reply says its site's group is broken is absent until it registers again (a
restarted site: a fresh group), as one silent past ``heartbeat_timeout`` is until heard from.
"""

from __future__ import annotations

import hmac
import itertools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fedweave.transports.grpc.certs import hash_token, token_entry
from fedweave.errors import SerializationError, TransportError
from fedweave.transports.base import Exchange
from fedweave.transports.grpc import protocol as p
from fedweave.transports.grpc.health import Health
from fedweave.transports.serialization import FRAME, FrameDecoder, SiteJob, SiteReply, ascii_id, encode_frames
from fedweave.transports.grpc.jobs import Job, check_answer, expected_shapes, payload_nbytes
from fedweave.transports.grpc.uploads import UploadWatchdog
from fedweave.types import Message, Update

if TYPE_CHECKING:
    from fedweave.config import GrpcConfig

log = logging.getLogger(__name__)


@dataclass
class _Client:
    session: str
    peer: str
    last_seen: float
    told_to_stop: bool = False
    broken: str | None = None  # a site leader's report that its site's group is broken, for this session
    examples: int | None = None  # the training examples it declared at registration, if it did


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
        self._admit = admit  # the reason to refuse a node's registration from what it declared, or None
        self._grpc = grpc
        # One lock; the server's condition wakes whoever waits for nodes (an exchange, a new
        # registration, the close), and each node's own condition wakes only that node's pull,
        # so posting or finishing one job wakes one thread, not every waiting pull.
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._wake: dict[int, threading.Condition] = {}
        self._clients: dict[int, _Client] = {}
        self._jobs: dict[int, Job] = {}
        self._posted: list[Job] = []  # jobs posted one by one (asynchronous aggregation), not yet collected
        self._tokens = p.token_hashes(settings)
        self._closing = False
        self._closed = False
        self._joined = False  # the first exchange waits for clients to register
        self._first_round: float | None = None  # when it began: an unregistered node is silent since then
        self._epoch = secrets.token_hex(3)
        self._count = 0
        handler = grpc.method_handlers_generic_handler(
            p.SERVICE,
            {
                p.REGISTER: grpc.unary_unary_rpc_method_handler(self._register, p.identity, p.identity),
                p.HEARTBEAT: grpc.unary_unary_rpc_method_handler(self._heartbeat, p.identity, p.identity),
                p.PULL: grpc.unary_stream_rpc_method_handler(self._pull, p.identity, p.identity),
                p.PUSH: grpc.stream_unary_rpc_method_handler(self._push, p.identity, p.identity),
                p.PUSH_ONE: grpc.unary_unary_rpc_method_handler(self._push_one, p.identity, p.identity),
            },
        )
        # Each client holds at most one pull and one push; heartbeats and registrations are short.
        pool = ThreadPoolExecutor(max_workers=2 * num_nodes + 8, thread_name_prefix="fedweave-grpc")
        self._server = grpc.server(pool, handlers=[handler], options=p.options(settings, server=True))
        bind = listen or settings.listen or settings.address
        credentials = p.server_credentials(settings)
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
        self.address = f"{bind.rpartition(':')[0]}:{port}"
        self.health = Health(grpc, self._server, settings.health_listen)
        self._server.start()
        self.health.serving()
        log.info("gRPC server listening on %s (tls: %s, tokens: %s)", self.address, settings.tls, settings.tokens)
        for warning in p.security_warnings(settings, server=True):
            log.warning(warning)

    # ------------------------------------------------------------------ Transport

    def exchange(self, messages: list[Message], timeout: float | None) -> Exchange:
        if not messages:
            return Exchange()
        self._join()
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        with self._cond:
            jobs = [self._new_job(msg, deadline, timeout) for msg in messages]
            try:
                while True:
                    self._expire(jobs, time.monotonic())
                    if not any(job.open for job in jobs):
                        break
                    wait = 0.25 if deadline is None else min(0.25, deadline - time.monotonic())
                    self._cond.wait(max(wait, 0.0))
            finally:
                self._release(jobs)
        return self._result(jobs, time.monotonic() - start)

    def post(self, messages: list[Message], timeout: float | None) -> None:
        """Post each message as its node's job and return at once; :meth:`collect` takes the
        answers as they come (asynchronous aggregation). Each job has its own ``timeout``."""
        if not messages:
            return
        self._join()
        now = time.monotonic()
        with self._cond:
            deadline = None if timeout is None else now + timeout
            self._posted.extend(self._new_job(msg, deadline, timeout) for msg in messages)

    def collect(self, wait: float) -> Exchange:
        """The posted jobs that ended (answered, failed, lost, past their deadline), waiting up to
        ``wait`` s for the first; the others stay posted."""
        end = time.monotonic() + wait
        with self._cond:
            while True:
                self._expire(self._posted, time.monotonic())
                ended = [job for job in self._posted if not job.open]
                remaining = end - time.monotonic()
                if ended or remaining <= 0 or not self._posted:
                    break
                self._cond.wait(min(0.25, remaining))
            self._posted = [job for job in self._posted if job.open]
            self._release(ended)
        return self._result(ended, None)

    def _join(self) -> None:
        """Before the first job: wait for the nodes to register (``grpc.join_timeout``)."""
        if not self._joined:
            self._joined = True
            joined = self.wait_for_clients(self.num_nodes, self.settings.join_timeout)
            log.info("%d of %d %ss registered before the first round", joined, self.num_nodes, self.role)
        if self._first_round is None:
            self._first_round = time.monotonic()

    def _new_job(self, msg: Message, deadline: float | None, timeout: float | None) -> Job:
        """Post ``msg`` as its node's job (the caller holds the lock); the node's pull wakes."""
        self._count += 1
        job_id = f"{self._epoch}-{self._count}"
        job = Job(job_id, msg.client_id, msg, expected_shapes(msg), deadline=deadline, timeout=timeout,
                   posted=time.monotonic())
        self._jobs[msg.client_id] = job
        self._wake_of(msg.client_id).notify_all()
        return job

    def _expire(self, jobs: list[Job], now: float) -> None:
        """Fail the open jobs whose node has gone silent or whose deadline has passed (lock held)."""
        lost_after = self.settings.heartbeat_timeout
        for job in jobs:
            if not job.open:
                continue
            # silent since its last sign of life, which may be rounds ago: a node
            # lost in an earlier round fails at once until it is heard from again
            client = self._clients.get(job.client_id)
            seen = client.last_seen if client is not None else self._first_round or now
            if now - seen > lost_after:
                what = "registered" if client is None else "sent a heartbeat"
                self._close_job(job, failed=f"lost: it has not {what} for {now - seen:.1f} s")
            elif job.deadline is not None and now >= job.deadline:
                self._close_job(job, failed=f"missed the round deadline ({job.timeout:g} s)")

    def _release(self, jobs: list[Job]) -> None:
        """Drop ended jobs (an open one fails as interrupted), so memory does not grow (lock held)."""
        for job in jobs:
            if job.open:
                self._close_job(job, failed="the exchange was interrupted")
            if self._jobs.get(job.client_id) is job:
                del self._jobs[job.client_id]

    def _result(self, jobs: list[Job], waited: float | None) -> Exchange:
        result = Exchange(waited=waited)
        for job in jobs:  # replies in the order of the messages, as in simulation
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
                log.warning("round %d: %s %d failed: %s", job.message.round, self.role, job.client_id, job.reason)
        return result

    def wait_for_clients(self, count: int, timeout: float) -> int:
        """Wait until ``count`` nodes have registered (at most ``timeout`` s); return how many did."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self._clients) < count and time.monotonic() < deadline:
                self._cond.wait(min(0.25, max(deadline - time.monotonic(), 0.0)))
            return len(self._clients)

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
            gone = self._gone(time.monotonic())
            if self.num_nodes - len(gone) < wait_for and self.settings.join_timeout > 0:
                log.warning("%d of %d %ss are present, fewer than the %d a round needs; waiting up to %g s "
                            "(grpc.join_timeout) for the others to come back", self.num_nodes - len(gone),
                            self.num_nodes, self.role, wait_for, self.settings.join_timeout)
            while self.num_nodes - len(gone) < wait_for and not self._closing:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(min(0.25, remaining))
                gone = self._gone(time.monotonic())
            return gone

    def _gone(self, now: float) -> frozenset[int]:
        """The nodes silent past heartbeat_timeout at ``now``, and the broken sites (lock held)."""
        if self._first_round is None:
            return frozenset()
        seen = {cid: self._first_round for cid in range(self.num_nodes)}
        seen.update((cid, c.last_seen) for cid, c in self._clients.items())
        broken = {cid for cid, c in self._clients.items() if c.broken is not None}
        return frozenset(cid for cid, t in seen.items() if now - t > self.settings.heartbeat_timeout or cid in broken)

    def node_counts(self) -> tuple[int, int]:
        """(registered, alive) nodes, alive meaning heard from within heartbeat_timeout (for monitoring)."""
        now = time.monotonic()
        with self._lock:
            seen = [c.last_seen for c in self._clients.values()]
        return len(seen), sum(now - t <= self.settings.heartbeat_timeout for t in seen)

    def close(self) -> None:
        """Tell every live client to stop (on its next pull or heartbeat), then stop serving."""
        with self._cond:
            if self._closed:
                return
            self._closing = True
            for wake in self._wake.values():
                wake.notify_all()
            s = self.settings
            deadline = time.monotonic() + s.poll_timeout + s.heartbeat_interval + 1.0
            while time.monotonic() < deadline:
                now = time.monotonic()
                waiting = [
                    c for c in self._clients.values()
                    if not c.told_to_stop and now - c.last_seen <= s.heartbeat_timeout
                ]
                if not waiting:
                    break
                self._cond.wait(0.1)
            self._closed = True
            self._jobs.clear()
        self.health.close()
        self._server.stop(grace=1.0).wait(timeout=5.0)
        log.info("gRPC server on %s stopped", self.address)

    # ------------------------------------------------------------------ RPC handlers

    def _refuse(self, context: Any, code: Any, why: str) -> None:
        log.warning("refused a call from %s: %s", context.peer(), why)
        context.abort(code, why)

    def _authenticate(self, context: Any, registering: bool = False) -> int:
        codes = self._grpc.StatusCode
        metadata = dict(context.invocation_metadata())
        key = p.ROLE_KEYS[self.role]
        (other,) = set(p.ROLE_KEYS.values()) - {key}
        if key not in metadata and other in metadata:
            kind = "site leaders" if self.role == "site" else "clients"
            why = f"{other} {metadata[other]!r}: this server serves {kind} (topology.kind differs from the server's?)"
            self._refuse(context, codes.UNAUTHENTICATED, why)
        raw = metadata.get(key, "")
        number = ascii_id(raw)
        if number is None or not 0 <= number < self.num_nodes:
            why = f"unknown {self.role} id {str(raw)[:40]!r} ({self.role}s are 0..{self.num_nodes - 1})"
            self._refuse(context, codes.UNAUTHENTICATED, why)
        node = p.Node(self.role, number)
        cid = node.id
        if self._tokens is not None:
            token, expected = metadata.get(p.TOKEN_KEY), self._tokens.get(token_entry(node.name))
            if token is None or expected is None or not hmac.compare_digest(hash_token(str(token)), expected):
                self._refuse(context, codes.UNAUTHENTICATED, f"{node}: missing or wrong token")
        if self.settings.tls == "mtls":
            names = [n.decode(errors="replace") for n in context.auth_context().get("x509_common_name", [])]
            if names != [node.name]:
                self._refuse(context, codes.PERMISSION_DENIED, f"{node}: its certificate belongs to {names}")
        if not registering:
            with self._cond:
                client = self._clients.get(cid)
                if client is None or metadata.get(p.SESSION_KEY) != client.session:
                    why = f"{node} is not registered (or was replaced); register again"
                    context.abort(codes.FAILED_PRECONDITION, why)
                client.last_seen = time.monotonic()
        return cid

    def _wake_of(self, cid: int) -> threading.Condition:
        """Node ``cid``'s condition (on the server's lock, which the caller holds)."""
        wake = self._wake.get(cid)
        if wake is None:
            wake = self._wake[cid] = threading.Condition(self._lock)
        return wake

    def _alive(self, cid: int) -> None:
        client = self._clients.get(cid)
        if client is not None:
            client.last_seen = time.monotonic()

    def _register(self, request: bytes, context: Any) -> bytes:
        cid = self._authenticate(context, registering=True)
        try:
            body = p.decode_json(request)
            version = body.get("version")
        except SerializationError as exc:
            body, version = {}, f"unreadable ({exc})"
        if version != p.VERSION:
            why = (
                f"{self.role} {cid} speaks protocol version {version}, this server {p.VERSION}: "
                "run one fedweave version on every node"
            )
            self._refuse(context, self._grpc.StatusCode.INVALID_ARGUMENT, why)
        refusal = None if self._admit is None else self._admit(body.get(p.DATA_SCHEMA_KEY))
        try:
            examples = p.declared_examples(body.get(p.EXAMPLES_KEY))
        except ValueError as exc:
            refusal = refusal or str(exc)
        if refusal is not None:
            self._refuse(context, self._grpc.StatusCode.INVALID_ARGUMENT, f"{self.role} {cid} may not join: {refusal}")
        session = secrets.token_hex(8)
        with self._cond:
            current = self._clients.get(cid)
            # A second claim must not take a live node's place: unauthenticated, anyone may claim any id;
            # authenticated, two processes holding one node's credentials would replace each other every
            # call. A restarted node (it retries) gets in once its predecessor has been silent for
            # heartbeat_timeout; a site leader whose group broke, at once (its restarted site).
            silent = time.monotonic() - current.last_seen if current is not None else 0.0
            taken = current is not None and current.broken is None and silent <= self.settings.heartbeat_timeout
            if not taken:
                self._clients[cid] = _Client(session, context.peer(), time.monotonic(), examples=examples)
                self._cond.notify_all()
        if taken:
            assert current is not None
            why = (
                f"{self.role} {cid} is already connected (from {current.peer}, heard from {silent:.1f} s ago): "
                f"another process may not take its place until it has been silent for grpc.heartbeat_timeout "
                f"({self.settings.heartbeat_timeout:g} s)"
            )
            self._refuse(context, self._grpc.StatusCode.ALREADY_EXISTS, why)
        again = current is not None
        log.info("%s %d %s from %s", self.role, cid, "registered again" if again else "registered", context.peer())
        return p.encode_json(
            {"session": session, "heartbeat_interval": self.settings.heartbeat_interval, "closing": self._closing}
        )

    def declared_examples(self) -> dict[int, int]:
        """The training examples each registered node declared, by its authenticated id."""
        with self._cond:
            return {cid: c.examples for cid, c in self._clients.items() if c.examples is not None}

    def _heartbeat(self, request: bytes, context: Any) -> bytes:
        cid = self._authenticate(context)
        with self._cond:
            if self._closing:
                self._clients[cid].told_to_stop = True
                self._cond.notify_all()
        return p.encode_json({"closing": self._closing})

    def _pull(self, request: bytes, context: Any) -> Iterator[bytes]:
        cid = self._authenticate(context)
        deadline = time.monotonic() + self.settings.poll_timeout
        job: Job | None = None
        stop = False
        with self._cond:
            while True:
                if self._closing:
                    self._clients[cid].told_to_stop = True
                    self._cond.notify_all()
                    stop = True
                    break
                candidate = self._jobs.get(cid)
                if candidate is not None and candidate.state in ("pending", "sent"):
                    # "sent" too: a client only pulls when it holds no work, so it lost that job
                    job = candidate
                    job.state = "sending"
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not context.is_active():
                    break
                self._alive(cid)  # a node waiting for work is alive: it needs no heartbeats meanwhile
                self._wake_of(cid).wait(min(remaining, 1.0))
        if stop:
            yield p.control_frame({"type": "shutdown"})
            return
        if job is None:
            yield p.control_frame({"type": "idle"})
            return
        delivered, sent = False, 0
        try:
            frames = encode_frames(job.message, self.settings.chunk_bytes, self.settings.checksum)
            first = next(frames, None)
            if first is not None and len(first) > p.MAX_INLINE_BYTES:  # on its own, after the control frame
                frames, first = itertools.chain((first,), frames), None
            yield p.control_frame({"type": "job", "job": job.id, "round": job.message.round}, first)
            sent += 0 if first is None else len(first) - FRAME.size
            for frame in frames:
                if not job.open:  # its round is over (deadline, lost): the link has better uses
                    break
                self._alive(cid)  # a long download on a slow link is a sign of life too
                yield frame
                sent += len(frame) - FRAME.size
            else:
                delivered = True
        finally:
            with self._cond:
                if job.state == "sending":
                    job.state = "sent" if delivered else "pending"
                job.bytes_sent += sent if delivered else 0
                if job.state == "pending":  # the node may pull it again
                    self._wake_of(cid).notify_all()
            if not delivered and job.open:
                log.info("round %d: sending to %s %d broke off; it may pull again", job.message.round, self.role, cid)
        if not delivered:
            log.info("round %d: stopped sending job %s to %s %d: %s", job.message.round, job.id, self.role, cid, job.reason)
            context.abort(self._grpc.StatusCode.ABORTED, f"job {job.id} is closed (its round is over): {job.reason}")

    def _push_one(self, request: bytes, context: Any) -> bytes:
        """A reply of one frame, in one unary call (:meth:`_push` without the stream's cost)."""
        return self._push(iter((request,)), context)

    def _push(self, request_iterator: Iterator[bytes], context: Any) -> bytes:
        codes = self._grpc.StatusCode
        cid = self._authenticate(context)
        job_id = dict(context.invocation_metadata()).get(p.JOB_KEY)
        with self._cond:
            job = self._jobs.get(cid)
            if job is None or job.id != job_id or not job.open:
                context.abort(codes.FAILED_PRECONDITION, f"job {job_id} of {self.role} {cid} is closed (its round is over)")
        s = self.settings
        decoder = FrameDecoder(
            max_chunk_bytes=s.chunk_bytes,
            max_bytes=p.max_message_bytes(s),
            expected=job.expected,
            require_checksum=s.checksum,
        )
        rnd = job.message.round
        watchdog = UploadWatchdog(context, s.push_grace, s.push_min_rate)
        try:
            for frame in request_iterator:
                watchdog.received(len(frame))
                self._alive(cid)  # a long upload on a slow link is a sign of life, as a heartbeat is
                control = p.parse_control(frame)
                if control is None:
                    decoder.feed(frame)
                    continue
                if p.inline_frame(frame) is not None:
                    raise SerializationError("a control frame with data inline in a reply")
                if control["type"] != "error":
                    raise SerializationError(f"unexpected control frame {control['type']!r} in a reply")
                reason = str(control.get("reason", ""))[:500]
                log.warning("round %d: %s %d reports an error: %s", rnd, self.role, cid, reason)
                self._close_job(job, failed=f"{self.role} error: {reason}")
                return p.encode_json({"ok": True})
            watchdog.stop()
            if watchdog.too_slow is not None:  # the cancelled stream ends as if it were complete
                raise self._grpc.RpcError(watchdog.too_slow)
            reply = decoder.finish()
            self._check_reply(job, reply)
        except SerializationError as exc:
            log.warning("round %d: reply of %s %d refused: %s: %s", rnd, self.role, cid, type(exc).__name__, exc)
            self._close_job(job, failed=f"rejected: {type(exc).__name__}: {exc}")
            context.abort(codes.INVALID_ARGUMENT, f"{type(exc).__name__}: {exc}")
        except self._grpc.RpcError as exc:
            if watchdog.too_slow is not None:
                log.warning("round %d: reply of %s %d cut off: %s", rnd, self.role, cid, watchdog.too_slow)
                self._close_job(job, failed=f"rejected: {watchdog.too_slow}")
                context.abort(codes.DEADLINE_EXCEEDED, watchdog.too_slow)
            log.info("round %d: reply of %s %d broke off (%s); it may push again", rnd, self.role, cid, exc)
            context.abort(codes.ABORTED, "the reply stream broke off")
        finally:
            watchdog.stop()
        if isinstance(reply.body, SiteReply) and reply.body.broken is not None:  # known before its round ends
            self._mark_broken(cid, dict(context.invocation_metadata()).get(p.SESSION_KEY), reply.body.broken)
        self._close_job(job, reply=reply, received=decoder.stream.received)
        return p.encode_json({"ok": True})

    def _mark_broken(self, cid: int, session: str | None, reason: str) -> None:
        """Site ``cid`` reports its group broken: absent until it registers again (a new session)."""
        with self._cond:
            client = self._clients.get(cid)
            if client is None or client.session != session or client.broken is not None:
                return  # registered again meanwhile (a restarted site), or already known
            client.broken = reason[:500]
        log.warning(
            "site %d reports its group broken (%s): later rounds sample around its members until it registers again",
            cid, client.broken,
        )

    @staticmethod
    def _check_reply(job: Job, reply: Message) -> None:
        sent = job.message
        if reply.client_id != job.client_id or reply.round != sent.round:
            raise SerializationError(
                f"reply is for node {reply.client_id} round {reply.round}, expected node "
                f"{job.client_id} round {sent.round}"
            )
        if not isinstance(sent.body, SiteJob):
            check_answer(sent, reply.body)
            return
        if not isinstance(reply.body, SiteReply):
            raise SerializationError(f"reply holds a {type(reply.body).__name__}, expected a SiteReply")
        members = {m.client_id: m for m in sent.body.messages}
        counted = 0
        covered: set[int] = set(reply.body.failures)
        for item in reply.body.messages:
            if item.client_id not in members:
                raise SerializationError(f"the site answers for client {item.client_id}, which is not in its job")
            check_answer(members[item.client_id], item.body)
            counted += item.body.clients if isinstance(item.body, Update) else 1
            named = item.body.senders if isinstance(item.body, Update) else [item.client_id]
            ids = set(named)
            if item.client_id not in ids or len(ids) < len(named) or not ids <= set(members) or ids & covered:
                raise SerializationError(
                    f"the site's answer for client {item.client_id} stands for clients {named}: not each of them "
                    "once, including that client, from its job and not answered or failed already"
                )
            covered |= ids
        strangers = sorted(set(reply.body.failures) - set(members))
        if strangers:
            raise SerializationError(f"the site reports failures of clients {strangers}, which are not in its job")
        if counted + len(reply.body.failures) != len(members):
            raise SerializationError(
                f"the site's answers stand for {counted} clients and its failures for {len(reply.body.failures)}, "
                f"but its job had {len(members)}"
            )

    def _close_job(
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
