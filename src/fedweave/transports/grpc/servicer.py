"""The server's RPC handlers: register, heartbeat, pull a job, push its reply
(:class:`~fedweave.transports.grpc.server.GrpcServerTransport` serves them).

Clients pull their job (server-streaming, ~1 MiB frames) and push their reply
(client-streaming, or one unary call when it is one frame).
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from fedweave.errors import SerializationError
from fedweave.transports.grpc import protocol as p
from fedweave.transports.grpc.auth import Authenticator, abort, refuse
from fedweave.transports.grpc.board import JobBoard
from fedweave.transports.grpc.heartbeats import Heartbeats, NodeRecord
from fedweave.transports.grpc.jobs import Job, check_reply
from fedweave.transports.grpc.uploads import UploadWatchdog
from fedweave.transports.serialization import FRAME, FrameDecoder, SiteReply, encode_frames
from fedweave.types import Message

if TYPE_CHECKING:
    from fedweave.config import GrpcConfig

log = logging.getLogger("fedweave.transports.grpc.server")  # one server, one log to follow


class Servicer:
    """The handlers of one server's RPCs, over its board, its nodes and its authenticator."""

    def __init__(
        self,
        grpc: Any,
        settings: GrpcConfig,
        role: str,
        *,
        cond: threading.Condition,
        board: JobBoard,
        nodes: Heartbeats,
        auth: Authenticator,
        closing: Callable[[], bool],
        admit: Callable[[Any], str | None] | None,
    ):
        self._grpc = grpc
        self.settings = settings
        self.role = role
        self._cond = cond
        self._board = board
        self._nodes = nodes
        self._auth = auth
        self._closing = closing
        self._admit = admit  # the reason to refuse a node's registration from what it declared, or None

    def handler(self) -> Any:
        """The generic handler of the service, for ``grpc.server``."""
        grpc = self._grpc
        return grpc.method_handlers_generic_handler(
            p.SERVICE,
            {
                p.REGISTER: grpc.unary_unary_rpc_method_handler(self.register, p.identity, p.identity),
                p.HEARTBEAT: grpc.unary_unary_rpc_method_handler(self.heartbeat, p.identity, p.identity),
                p.PULL: grpc.unary_stream_rpc_method_handler(self.pull, p.identity, p.identity),
                p.PUSH: grpc.stream_unary_rpc_method_handler(self.push, p.identity, p.identity),
                p.PUSH_ONE: grpc.unary_unary_rpc_method_handler(self.push_one, p.identity, p.identity),
            },
        )

    # ------------------------------------------------------------------ register, heartbeat

    def register(self, request: bytes, context: Any) -> bytes:
        cid = self._auth.authenticate(context, registering=True)
        examples = self._admitted(cid, request, context)
        session = secrets.token_hex(8)
        with self._cond:
            current = self._nodes.nodes.get(cid)
            # A second claim must not take a live node's place: unauthenticated, anyone may claim any id;
            # authenticated, two processes holding one node's credentials would replace each other every
            # call. A restarted node (it retries) gets in once its predecessor has been silent for
            # heartbeat_timeout; a site leader whose group broke, at once (its restarted site).
            silent = time.monotonic() - current.last_seen if current is not None else 0.0
            taken = current is not None and current.broken is None and silent <= self.settings.heartbeat_timeout
            if not taken:
                self._nodes.nodes[cid] = NodeRecord(session, context.peer(), time.monotonic(), examples=examples)
                self._cond.notify_all()
        if taken:
            assert current is not None
            why = (
                f"{self.role} {cid} is already connected (from {current.peer}, heard from {silent:.1f} s ago): "
                f"another process may not take its place until it has been silent for grpc.heartbeat_timeout "
                f"({self.settings.heartbeat_timeout:g} s)"
            )
            refuse(context, self._grpc.StatusCode.ALREADY_EXISTS, why)
        again = current is not None
        log.info("%s %d %s from %s", self.role, cid, "registered again" if again else "registered", context.peer())
        return p.encode_json(
            {"session": session, "heartbeat_interval": self.settings.heartbeat_interval, "closing": self._closing()}
        )

    def _admitted(self, cid: int, request: bytes, context: Any) -> int | None:
        """The examples node ``cid`` declares, once its protocol version and its declaration are
        accepted; else the call is refused."""
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
            refuse(context, self._grpc.StatusCode.INVALID_ARGUMENT, why)
        refusal = None if self._admit is None else self._admit(body.get(p.DATA_SCHEMA_KEY))
        examples = None
        try:
            examples = p.declared_examples(body.get(p.EXAMPLES_KEY))
        except ValueError as exc:
            refusal = refusal or str(exc)
        if refusal is not None:
            refuse(context, self._grpc.StatusCode.INVALID_ARGUMENT, f"{self.role} {cid} may not join: {refusal}")
        return examples

    def heartbeat(self, request: bytes, context: Any) -> bytes:
        cid = self._auth.authenticate(context)
        with self._cond:
            if self._closing():
                self._nodes.nodes[cid].told_to_stop = True
                self._cond.notify_all()
        return p.encode_json({"closing": self._closing()})

    # ------------------------------------------------------------------ pull

    def pull(self, request: bytes, context: Any) -> Iterator[bytes]:
        cid = self._auth.authenticate(context)
        stop, job = self._await_job(cid, context)
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
                self._nodes.alive(cid)  # a long download on a slow link is a sign of life too
                yield frame
                sent += len(frame) - FRAME.size
            else:
                delivered = True
        finally:
            self._sent(cid, job, delivered, sent)
        if not delivered:
            log.info("round %d: stopped sending job %s to %s %d: %s", job.message.round, job.id, self.role, cid, job.reason)
            abort(context, self._grpc.StatusCode.ABORTED, f"job {job.id} is closed (its round is over): {job.reason}")

    def _await_job(self, cid: int, context: Any) -> tuple[bool, Job | None]:
        """(stop, job): wait up to ``grpc.poll_timeout`` for node ``cid``'s job; stop when the server closes."""
        deadline = time.monotonic() + self.settings.poll_timeout
        with self._cond:
            while True:
                if self._closing():
                    self._nodes.nodes[cid].told_to_stop = True
                    self._cond.notify_all()
                    return True, None
                candidate = self._board.jobs.get(cid)
                if candidate is not None and candidate.state in ("pending", "sent"):
                    # "sent" too: a client only pulls when it holds no work, so it lost that job
                    candidate.state = "sending"
                    return False, candidate
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not context.is_active():
                    return False, None
                self._nodes.alive(cid)  # a node waiting for work is alive: it needs no heartbeats meanwhile
                self._board.wake_of(cid).wait(min(remaining, 1.0))

    def _sent(self, cid: int, job: Job, delivered: bool, sent: int) -> None:
        """A pull of ``job`` ended: sent, or pending again (the node may pull it again)."""
        with self._cond:
            if job.state == "sending":
                job.state = "sent" if delivered else "pending"
            job.bytes_sent += sent if delivered else 0
            if job.state == "pending":  # the node may pull it again
                self._board.wake_of(cid).notify_all()
        if not delivered and job.open:
            log.info("round %d: sending to %s %d broke off; it may pull again", job.message.round, self.role, cid)

    # ------------------------------------------------------------------ push

    def push_one(self, request: bytes, context: Any) -> bytes:
        """A reply of one frame, in one unary call (:meth:`push` without the stream's cost)."""
        return self.push(iter((request,)), context)

    def push(self, request_iterator: Iterator[bytes], context: Any) -> bytes:
        codes = self._grpc.StatusCode
        cid = self._auth.authenticate(context)
        job_id = dict(context.invocation_metadata()).get(p.JOB_KEY)
        with self._cond:
            job = self._board.jobs.get(cid)
            if job is None or job.id != job_id or not job.open:
                abort(context, codes.FAILED_PRECONDITION, f"job {job_id} of {self.role} {cid} is closed (its round is over)")
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
                self._nodes.alive(cid)  # a long upload on a slow link is a sign of life, as a heartbeat is
                control = p.parse_control(frame)
                if control is None:
                    decoder.feed(frame)
                    continue
                self._reported_error(cid, job, frame, control)
                return p.encode_json({"ok": True})
            watchdog.stop()
            if watchdog.too_slow is not None:  # the cancelled stream ends as if it were complete
                raise self._grpc.RpcError(watchdog.too_slow)
            reply = decoder.finish()
            check_reply(job, reply)
        except SerializationError as exc:
            log.warning("round %d: reply of %s %d refused: %s: %s", rnd, self.role, cid, type(exc).__name__, exc)
            self._board.close_job(job, failed=f"rejected: {type(exc).__name__}: {exc}")
            abort(context, codes.INVALID_ARGUMENT, f"{type(exc).__name__}: {exc}")
        except self._grpc.RpcError as exc:
            if watchdog.too_slow is not None:
                log.warning("round %d: reply of %s %d cut off: %s", rnd, self.role, cid, watchdog.too_slow)
                self._board.close_job(job, failed=f"rejected: {watchdog.too_slow}")
                abort(context, codes.DEADLINE_EXCEEDED, watchdog.too_slow)
            log.info("round %d: reply of %s %d broke off (%s); it may push again", rnd, self.role, cid, exc)
            abort(context, codes.ABORTED, "the reply stream broke off")
        finally:
            watchdog.stop()
        self._answered(cid, job, reply, decoder.stream.received, context)
        return p.encode_json({"ok": True})

    def _reported_error(self, cid: int, job: Job, frame: bytes, control: dict[str, Any]) -> None:
        """A control frame in a reply: the node reports an error, which fails its job; anything else is refused."""
        if p.inline_frame(frame) is not None:
            raise SerializationError("a control frame with data inline in a reply")
        if control["type"] != "error":
            raise SerializationError(f"unexpected control frame {control['type']!r} in a reply")
        reason = str(control.get("reason", ""))[:500]
        log.warning("round %d: %s %d reports an error: %s", job.message.round, self.role, cid, reason)
        self._board.close_job(job, failed=f"{self.role} error: {reason}")

    def _answered(self, cid: int, job: Job, reply: Message, received: int, context: Any) -> None:
        """``job`` is answered; a site whose reply says its group broke is known to be broken at once,
        before its round ends."""
        if isinstance(reply.body, SiteReply) and reply.body.broken is not None:
            self._nodes.mark_broken(cid, dict(context.invocation_metadata()).get(p.SESSION_KEY), reply.body.broken)
        self._board.close_job(job, reply=reply, received=received)
