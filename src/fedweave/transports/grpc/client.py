"""The client side of the gRPC transport: one node's connection to the server.

The node is a client, or the site leader of a hierarchical deployment (``role="site"``:
its jobs are :class:`~fedweave.transports.serialization.SiteJob` batches). :class:`GrpcClient` registers, sends heartbeats from a thread of their own (so a long
local training keeps the client alive), pulls each job, runs it through ``handler``
(the client runtime) and pushes the reply. A failed call is retried with exponential
backoff, also across a network blip, for at most ``grpc.connect_timeout`` seconds of
continuous failure; refused credentials end the client at once. The client stops when
the server says so (graceful shutdown) or when :meth:`GrpcClient.stop` is called.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from fedweave.errors import SerializationError, TransportError
from fedweave.transports.grpc import protocol as p
from fedweave.transports.serialization import FrameDecoder, encode_frames
from fedweave.types import Message

if TYPE_CHECKING:
    from fedweave.config import GrpcConfig

log = logging.getLogger(__name__)

Handler = Callable[[Message], Message]
T = TypeVar("T")


@dataclass
class _Job:
    id: str
    message: Message | None
    error: str | None = None


class _Shutdown:
    """The server asked this client to stop."""


class _Stopped(Exception):
    """:meth:`GrpcClient.stop` was called while a call was being retried."""


SHUTDOWN = _Shutdown()


class GrpcClient:
    """Serves the jobs of node ``node_id`` (a client id, or a site index with ``role="site"``)
    with ``handler`` until the server stops it."""

    def __init__(
        self,
        settings: GrpcConfig,
        node_id: int,
        handler: Handler,
        *,
        role: str = "client",
        address: str | None = None,
        token: str | None = None,
        seed: int = 0,
        declaration: dict[str, Any] | None = None,
        examples: int | None = None,
    ):
        grpc = p.grpc_module()
        self.settings = settings
        self.declaration = declaration  # what the node declares at registration (its data schema), if anything
        self.examples = examples  # its training examples, declared at registration: the ceiling of its claims
        self.node = p.Node(role, node_id)
        self.handler = handler
        self.address = address or settings.address
        self._grpc = grpc
        self._token = p.node_token(settings, self.node, token)
        for warning in p.security_warnings(settings, server=False):
            log.warning("%s: %s", self.node, warning)
        credentials = p.channel_credentials(settings, self.node)
        opts = p.options(settings, server=False)
        self._channel = (
            grpc.secure_channel(self.address, credentials, options=opts)
            if credentials is not None
            else grpc.insecure_channel(self.address, options=opts)
        )
        self._register_rpc = self._channel.unary_unary(p.method(p.REGISTER), p.identity, p.identity)
        self._heartbeat_rpc = self._channel.unary_unary(p.method(p.HEARTBEAT), p.identity, p.identity)
        self._pull_rpc = self._channel.unary_stream(p.method(p.PULL), p.identity, p.identity)
        self._push_rpc = self._channel.stream_unary(p.method(p.PUSH), p.identity, p.identity)
        self._push_one_rpc = self._channel.unary_unary(p.method(p.PUSH_ONE), p.identity, p.identity)
        self._session: str | None = None
        self._await_server = False  # register waits for the channel once the server was found not listening
        self._stop = threading.Event()
        self._working = threading.Event()  # from a job's first frame to its reply delivered: heartbeats on
        self._backoff = p.Backoff(settings.backoff_initial, settings.backoff_max, seed, role, node_id)
        self.jobs_done = 0

    def stop(self) -> None:
        """Stop after the current call (from another thread or a signal handler)."""
        self._stop.set()

    def run(self) -> int:
        """Serve jobs until the server says stop; return how many were answered."""
        beats = threading.Thread(target=self._heartbeats, name=f"fedweave-heartbeat-{self.node.name}", daemon=True)
        try:
            self._retrying("register", self._register)
            beats.start()
            while not self._stop.is_set():
                try:
                    job = self._retrying("pull", self._pull)
                    if job is SHUTDOWN:
                        log.info("%s: the server ended the run", self.node)
                        break
                    if job is None:
                        continue
                    assert isinstance(job, _Job)
                    self._serve(job)
                    self.jobs_done += 1
                finally:
                    self._working.clear()
        except _Stopped:
            log.info("%s stopped while retrying a call", self.node)
        finally:
            self._stop.set()
            if beats.is_alive():
                beats.join(timeout=self.settings.rpc_timeout + 1.0)
            self._channel.close()
        return self.jobs_done

    def _serve(self, job: _Job) -> None:
        """Run ``job`` through the handler and push its reply (or the error it raised)."""
        reply, error = None, job.error
        if error is None and job.message is not None:
            try:
                reply = self.handler(job.message)
            except Exception as exc:  # report it, so the server need not wait for a deadline
                rnd = job.message.round
                log.warning("%s: job of round %d failed: %s", self.node, rnd, exc, exc_info=True)
                error = f"{type(exc).__name__}: {exc}"
        job.message = None  # the instruction's tensors are not needed past training
        self._retrying("push", lambda: self._push(job.id, reply, error))

    # ------------------------------------------------------------------ calls

    def _metadata(self, job: str | None = None) -> list[tuple[str, str]]:
        metadata = [(self.node.key, str(self.node.id))]
        if self._token is not None:
            metadata.append((p.TOKEN_KEY, self._token))
        if self._session is not None:
            metadata.append((p.SESSION_KEY, self._session))
        if job is not None:
            metadata.append((p.JOB_KEY, job))
        return metadata

    def _register(self) -> None:
        self._session = None
        request: dict[str, Any] = {"version": p.VERSION}
        if self.declaration is not None:
            request[p.DATA_SCHEMA_KEY] = self.declaration
        if self.examples is not None:
            request[p.EXAMPLES_KEY] = self.examples
        reply = p.decode_json(
            self._register_rpc(
                p.encode_json(request),
                metadata=self._metadata(),
                timeout=self.settings.rpc_timeout,
                wait_for_ready=self._await_server,
            )
        )
        session = reply.get("session")
        if not isinstance(session, str):
            raise SerializationError("the server's registration reply holds no session")
        self._session = session
        log.info("%s registered with %s", self.node, self.address)

    def _heartbeats(self) -> None:
        """While the node works on a job (from its first frame to its reply delivered), a
        heartbeat every interval; a pull waiting for work is a sign of life of its own (the
        server counts it), so an idle node sends none. A heartbeat answered ``closing`` stops
        the node once its job's reply is pushed (or refused)."""
        while not self._stop.wait(self.settings.heartbeat_interval):
            if self._session is None or not self._working.is_set():
                continue
            try:
                reply = self._heartbeat_rpc(b"{}", metadata=self._metadata(), timeout=self.settings.rpc_timeout)
            except self._grpc.RpcError as exc:
                log.debug("%s: heartbeat failed: %s", self.node, exc.code())
                continue
            try:
                closing = p.decode_json(reply).get("closing") is True
            except SerializationError:
                closing = False
            if closing:  # the run ended while this node worked (asynchronous runs end so): no more calls
                log.info("%s: the server ended the run during its job", self.node)
                self._stop.set()

    def _pull(self) -> _Job | _Shutdown | None:
        s = self.settings
        frames = iter(self._pull_rpc(b"", metadata=self._metadata(), timeout=s.poll_timeout + s.stream_timeout))
        first = next(frames, None)
        if first is None:
            return None
        control = p.parse_control(first)
        if control is None or control["type"] == "idle":
            return None
        if control["type"] == "shutdown":
            return SHUTDOWN
        if control["type"] != "job" or not isinstance(control.get("job"), str):
            raise SerializationError(f"unexpected control frame {control!r}")
        self._working.set()  # a long download on a slow link is work too
        decoder = FrameDecoder(
            max_chunk_bytes=s.chunk_bytes, max_bytes=p.max_message_bytes(s), require_checksum=s.checksum
        )
        try:
            first_data = p.inline_frame(first)
            if first_data is not None:
                decoder.feed(first_data)
            for frame in frames:
                decoder.feed(frame)
            message = decoder.finish()
            if message.client_id != self.node.id:
                raise SerializationError(f"the job is for {self.node.role} {message.client_id}, not {self.node.id}")
        except SerializationError as exc:
            if hasattr(frames, "cancel"):
                frames.cancel()
            log.warning("%s: job %s refused: %s: %s", self.node, control["job"], type(exc).__name__, exc)
            return _Job(control["job"], None, f"instruction refused: {type(exc).__name__}: {exc}")
        return _Job(control["job"], message)

    def _push(self, job: str, reply: Message | None, error: str | None) -> None:
        s = self.settings

        if reply is None:
            frames: Iterator[bytes] = iter([p.control_frame({"type": "error", "reason": error or "no reply"})])
        else:
            frames = encode_frames(reply, s.chunk_bytes, s.checksum)
        first, second = next(frames), next(frames, None)
        metadata = self._metadata(job)
        try:
            if second is None:  # one frame: one unary call
                self._push_one_rpc(first, metadata=metadata, timeout=s.stream_timeout)
            else:
                self._push_rpc(itertools.chain((first, second), frames), metadata=metadata, timeout=s.stream_timeout)
        except self._grpc.RpcError as exc:
            if exc.code() == self._grpc.StatusCode.FAILED_PRECONDITION and "is closed" in (exc.details() or ""):
                log.info("%s: reply to job %s dropped: %s", self.node, job, exc.details())
                return
            raise

    def _retrying(self, what: str, call: Callable[[], T]) -> T:
        """``call()``, retried with backoff while the server is unreachable; re-registers when asked."""
        grpc = self._grpc
        failing_since: float | None = None
        mismatches = 0  # registrations in a row that failed for the TLS settings
        while True:
            try:
                result = call()
                self._backoff.reset()
                return result
            except grpc.RpcError as exc:
                code = exc.code()
                if p.refused(code):
                    log.error("%s: the server refused %s: %s", self.node, what, exc.details())
                    raise p.transport_error(f"{self.node}: the server refused {what}", exc) from None
                if code == grpc.StatusCode.FAILED_PRECONDITION and what != "register":
                    log.warning("%s: %s; registering again", self.node, exc.details())
                    self._retrying("register", self._register)
                    continue
                problem = f"{code.name}: {exc.details()}"
                if what == "register":
                    # a fail-fast call shows why a connection fails; once none is listening, wait for one
                    hint = p.connection_hint(exc.details(), self.settings.tls)
                    self._await_server = code == grpc.StatusCode.UNAVAILABLE and hint is None
                    mismatches = mismatches + 1 if hint is not None else 0
                    if mismatches >= 3:  # not a blip: the same refusal each time
                        log.error("%s: cannot register with %s: %s", self.node, self.address, hint)
                        raise TransportError(f"{self.node}: cannot register with {self.address}: {hint}") from None
            except SerializationError as exc:
                problem = f"{type(exc).__name__}: {exc}"
            now = time.monotonic()
            failing_since = now if failing_since is None else failing_since
            if now - failing_since > self.settings.connect_timeout:
                hint = f" (if TLS is on, check this {self.node.role}'s certificate)" if self.settings.tls != "none" else ""
                raise TransportError(
                    f"{self.node}: cannot {what} with {self.address} for "
                    f"{self.settings.connect_timeout:g} s{hint}; last error {problem}"
                )
            delay = self._backoff.next()
            log.info("%s: %s failed (%s); retrying in %.2f s", self.node, what, problem, delay)
            if self._stop.wait(delay):
                raise _Stopped
