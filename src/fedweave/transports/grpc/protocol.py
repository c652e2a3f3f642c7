"""The wire protocol between a fedweave server and its clients over gRPC.

Service ``fedweave.v1.Federation``, five methods, raw bytes (no protobuf):

============  ================  ======================================================
method        kind              what travels
============  ================  ======================================================
Register      unary             JSON in, JSON out: a session id and the heartbeat period
Heartbeat     unary             JSON in, JSON out: "alive"; the reply says when to stop
Pull          server-streaming  one CONTROL frame (``job`` / ``idle`` / ``shutdown``);
                                a ``job`` frame carries the job's first DATA frame after
                                its JSON (flag INLINE, the JSON's length in ``seq``),
                                the rest of its message follows as DATA frames
Push          client-streaming  the reply as DATA frames, or one CONTROL ``error`` frame
PushOne       unary             the same, when it is one frame
============  ================  ======================================================

A job whose first frame is at most ``MAX_INLINE_BYTES`` (every control step) and a reply
of one chunk (a model under ``chunk_bytes``) thus each travel as one gRPC message: every
extra message of a streaming call costs about 0.4 ms of Python gRPC here, as much as a
small message's whole encoding. A larger first frame goes on its own, after the CONTROL
frame: until a job's first frame has arrived its node sends no heartbeats, so that frame
must cross a slow link well within ``heartbeat_timeout``.

Register sends ``{"version": VERSION}``; a server refuses any other version (this layout
came with version 2; version 3 names the model of each compressed broadcast,
:data:`fedweave.plugins.compression.wire.MODEL`, which a node of version 2 would take for a
tensor of the model). A client whose site reads its own data adds ``"data_schema"`` (a
:class:`fedweave.task.schema.DataSchema`: sample shape, dtype, label kind, classes; never
data or label counts), and a server of such a federation refuses a registration whose schema
differs from its own, with the reason; it also adds ``"num_examples"``, its training-set size
(a whole number in 0..2^53, or the registration is refused), which the server binds to its
authenticated id as the ceiling of every claim it makes later.

Every call carries the caller's identity, ``fedweave-client`` (a client id) or, for the
site leader of a hierarchical deployment, ``fedweave-site`` (a top-level site index), and,
when the server asks for them, ``fedweave-token``; every call after Register also carries
``fedweave-session``, and Push the ``fedweave-job`` it answers. A server serves one kind of
node: clients (star) or site leaders (hierarchical). Frames are those of
:mod:`fedweave.transports.serialization`; a CONTROL frame has kind 2 and a JSON body.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedweave.transports.grpc import certs
from fedweave.errors import ConfigError, SerializationError, TransportError
from fedweave.seeding import derive_seed
from fedweave.federated.checks import MAX_EXAMPLES
from fedweave.transports.serialization import FRAME, load_json

if TYPE_CHECKING:
    from fedweave.config import GrpcConfig

SERVICE = "fedweave.v1.Federation"
REGISTER = "Register"
HEARTBEAT = "Heartbeat"
PULL = "Pull"
PUSH = "Push"
PUSH_ONE = "PushOne"

DATA_SCHEMA_KEY = "data_schema"
"""The field of a Register request that declares the client's data schema."""

EXAMPLES_KEY = "num_examples"
"""The field of a Register request that declares the client's training examples."""

CLIENT_KEY = "fedweave-client"
SITE_KEY = "fedweave-site"
TOKEN_KEY = "fedweave-token"
SESSION_KEY = "fedweave-session"
JOB_KEY = "fedweave-job"
ROLE_KEYS = {"client": CLIENT_KEY, "site": SITE_KEY}  # a node's role -> the call metadata that carries its id
TOKEN_ENV = "FEDWEAVE_TOKEN"
AUTO = "auto"
"""``grpc.credentials: auto``: the process launcher writes fresh credentials for each run."""
CREDENTIALS_ENV = "FEDWEAVE_CREDENTIALS"
"""Where the process launcher tells its nodes that run's credentials are."""

VERSION = 3
CONTROL = 2
INLINE = 1  # flag: a DATA frame follows the CONTROL frame's JSON, whose length is in seq
MAX_INLINE_BYTES = 64 << 10  # the largest first frame a job carries inline
MAX_CONTROL_BYTES = 64 << 10
FRAME_SLACK = 64 << 10  # gRPC message limit = chunk size + this


@dataclass(frozen=True)
class Node:
    """Who a gRPC peer of the server is: client ``id``, or the leader of top-level site ``id``."""

    role: str  # "client" | "site"
    id: int

    @property
    def name(self) -> str:
        """Its certificate's common name and the stem of its credential files."""
        return certs.client_name(self.id) if self.role == "client" else certs.site_name(self.id)

    @property
    def key(self) -> str:
        """The call metadata that carries its id."""
        return ROLE_KEYS[self.role]

    def __str__(self) -> str:
        return f"{self.role} {self.id}"


def authenticated(settings: GrpcConfig) -> bool:
    """Whether the server knows who calls it: a token per node, or a client certificate (mTLS)."""
    return settings.tokens or settings.tls == "mtls"


def security_warnings(settings: GrpcConfig, server: bool) -> list[str]:
    """What a node should warn about its security settings (one line each)."""
    warnings = []
    if server and not authenticated(settings) and not settings.allow_unauthenticated:
        warnings.append(
            "this gRPC server runs WITHOUT AUTHENTICATION (no tokens, no mTLS): anyone who reaches it can "
            "register as a node that is not connected, receive the model and send updates; create "
            "credentials with `fedweave certs` and set grpc.tls: mtls and grpc.tokens: true, or set "
            "grpc.allow_unauthenticated: true on a trusted network"
        )
    if settings.tokens and settings.tls == "none":
        warnings.append(
            "grpc.tokens with grpc.tls: none: the tokens travel in clear text, and anyone on the network path "
            "can read and reuse them; set grpc.tls: tls or mtls"
        )
    return warnings


def grpc_module() -> Any:
    """``import grpc``, or a ConfigError that names the extra to install."""
    try:
        import grpc
    except ImportError:
        raise ConfigError("transport 'grpc' needs grpcio: pip install 'fedweave[grpc]'") from None
    return grpc


def method(name: str) -> str:
    return f"/{SERVICE}/{name}"


def control_frame(payload: dict[str, Any], inline: bytes | None = None) -> bytes:
    """A CONTROL frame of ``payload``, carrying the DATA frame ``inline`` after it if given."""
    body = json.dumps(payload).encode()
    if inline is None:
        return FRAME.pack(CONTROL, 0, 0, 0, 0, 0) + body
    return b"".join((FRAME.pack(CONTROL, INLINE, 0, len(body), 0, 0), body, inline))


def _control_end(frame: bytes) -> int:
    """Where a CONTROL frame's JSON ends (checked: within the frame, within the size limit)."""
    _, flags, _, length, _, _ = FRAME.unpack_from(frame)
    end = len(frame)
    if flags & INLINE:
        if length > len(frame) - FRAME.size:
            raise SerializationError("corrupted control frame: its JSON runs past the frame")
        end = FRAME.size + length
    if end > MAX_CONTROL_BYTES:
        raise SerializationError(f"control frame of {end} bytes exceeds {MAX_CONTROL_BYTES}")
    return end


def inline_frame(frame: bytes) -> memoryview | None:
    """The DATA frame a CONTROL frame carries after its JSON (a job's first), or None."""
    if len(frame) < FRAME.size or frame[0] != CONTROL or not frame[1] & INLINE:
        return None
    return memoryview(frame)[_control_end(frame) :]


def parse_control(frame: bytes) -> dict[str, Any] | None:
    """The JSON of a CONTROL frame; None for any other frame."""
    if len(frame) < FRAME.size or frame[0] != CONTROL:
        return None
    end = _control_end(frame)
    value = load_json(memoryview(frame)[FRAME.size : end], "control frame")
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise SerializationError("corrupted control frame: no type")
    return value


def encode_json(value: dict[str, Any]) -> bytes:
    return json.dumps(value).encode()


def decode_json(data: bytes) -> dict[str, Any]:
    value = load_json(data, "request") if data else {}
    if not isinstance(value, dict):
        raise SerializationError("malformed request: not a JSON object")
    return value


def identity(data: bytes) -> bytes:
    return data


def max_message_bytes(settings: GrpcConfig) -> int:
    return int(settings.max_message_mb * (1 << 20))


def options(settings: GrpcConfig, server: bool) -> list[tuple[str, Any]]:
    """Channel / server options: message limits of one frame, keepalive, and a channel that
    re-dials a lost server at least every second (calls wait for it within their deadline)."""
    limit = settings.chunk_bytes + FRAME_SLACK
    common = [
        ("grpc.max_send_message_length", limit),
        ("grpc.max_receive_message_length", limit),
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]
    if server:
        return [*common, ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000), ("grpc.so_reuseport", 0)]
    return [
        *common,
        ("grpc.enable_retries", 0),
        ("grpc.initial_reconnect_backoff_ms", int(settings.backoff_initial * 1000)),
        ("grpc.min_reconnect_backoff_ms", int(settings.backoff_initial * 1000)),
        ("grpc.max_reconnect_backoff_ms", int(min(settings.backoff_max, 1.0) * 1000)),
    ]


def credentials_folder(settings: GrpcConfig) -> Path:
    """The folder of this node's credentials (``auto``: the one its process launcher wrote)."""
    if settings.credentials != AUTO:
        return Path(settings.credentials or ".")
    folder = os.environ.get(CREDENTIALS_ENV)
    if not folder:
        raise ConfigError(
            "config key 'grpc.credentials': 'auto' is for launcher: process, which creates credentials for each "
            "run on this machine; across machines create them with `fedweave certs --out DIR --clients N` and "
            "set grpc.credentials to DIR on every node"
        )
    return Path(folder)


def _read(folder: Path, name: str) -> bytes:
    path = folder / name
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(
            f"config key 'grpc.credentials': cannot read {str(path)!r} ({exc.strerror}); "
            "create the folder with `fedweave certs --out DIR --clients N [--sites S]`"
        ) from None


def server_credentials(settings: GrpcConfig) -> Any:
    """Server TLS credentials (None without TLS); ``mtls`` requires a client certificate signed by the CA."""
    if settings.tls == "none":
        return None
    grpc = grpc_module()
    folder = credentials_folder(settings)
    pair = (_read(folder, certs.SERVER_KEY), _read(folder, certs.SERVER_CERT))
    if settings.tls == "mtls":
        return grpc.ssl_server_credentials([pair], root_certificates=_read(folder, certs.CA_CERT), require_client_auth=True)
    return grpc.ssl_server_credentials([pair])


def channel_credentials(settings: GrpcConfig, node: Node) -> Any:
    """A node's TLS credentials (None without TLS): the CA, and with ``mtls`` the node's key pair."""
    if settings.tls == "none":
        return None
    grpc = grpc_module()
    folder = credentials_folder(settings)
    ca = _read(folder, certs.CA_CERT)
    if settings.tls == "mtls":
        return grpc.ssl_channel_credentials(
            ca, _read(folder, certs.key_file(node.name)), _read(folder, certs.cert_file(node.name))
        )
    return grpc.ssl_channel_credentials(ca)


def node_token(settings: GrpcConfig, node: Node, token: str | None = None) -> str | None:
    """The token a node presents: ``token``, else $FEDWEAVE_TOKEN, else credentials/<name>.token
    (``client-<id>.token``, ``site-<s>.token``)."""
    if token is None:
        token = os.environ.get(TOKEN_ENV)
    if token is None and settings.tokens:
        token = _read(credentials_folder(settings), certs.token_file(node.name)).decode().strip()
    return None if token is None else certs.check_token(token, f"the token of {node.name}")


def token_hashes(settings: GrpcConfig) -> dict[str, str] | None:
    """The server's SHA-256 of each node's token, by
    :func:`fedweave.transports.grpc.certs.token_entry` (None when tokens are not required)."""
    if not settings.tokens:
        return None
    raw = _read(credentials_folder(settings), certs.TOKENS)
    try:
        data = json.loads(raw.decode())
        return {str(k): str(v) for k, v in data.items()}
    except (UnicodeDecodeError, ValueError, AttributeError):
        raise ConfigError(f"config key 'grpc.credentials': {certs.TOKENS} is not a JSON object of tokens") from None


class Backoff:
    """Exponential retry delays with seeded jitter: initial, 2x, 4x, ... capped at ``maximum``."""

    def __init__(self, initial: float, maximum: float, seed: int, *keys: int | str):
        self.initial = initial
        self.maximum = maximum
        self.delay = initial
        self.rng = random.Random(derive_seed(seed, "backoff", *keys))

    def next(self) -> float:
        delay = self.delay * (0.5 + 0.5 * self.rng.random())
        self.delay = min(self.delay * 2, self.maximum)
        return delay

    def reset(self) -> None:
        self.delay = self.initial


def refused(code: Any) -> bool:
    """A status that retrying cannot fix (credentials, identity, protocol)."""
    grpc = grpc_module()
    return code in (
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.UNIMPLEMENTED,
    )


def connection_hint(details: str | None, tls: str) -> str | None:
    """Why a connection fails when the cause is the nodes' TLS settings (a failed handshake, or a
    server that closes the connection during set-up), read from gRPC's error details; else None."""
    text = details or ""
    if "CERTIFICATE_VERIFY_FAILED" in text:
        return (
            "TLS handshake failed: the server's certificate is not signed by this node's ca.pem "
            "(credentials from another `fedweave certs` run?)"
        )
    if "WRONG_VERSION_NUMBER" in text:
        return f"TLS handshake failed: the server does not speak TLS (this node has grpc.tls: {tls}; set it as on the server)"
    if "andshake failed" in text:
        return "TLS handshake failed: " + text.rsplit("andshake failed", 1)[1].strip(" :")
    if "Socket closed" in text and tls == "none":
        return (
            "the server closes every connection during set-up: it probably requires TLS "
            "(set grpc.tls and grpc.credentials as on the server)"
        )
    if "Socket closed" in text:
        return (
            f"the server closes every connection during the TLS handshake: does it require a client "
            f"certificate (grpc.tls: mtls) that this node lacks (grpc.tls: {tls}), or was this node's "
            "certificate signed by another CA?"
        )
    return None


def transport_error(what: str, exc: Any) -> TransportError:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return TransportError(f"{what}: {getattr(code, 'name', code)}: {details}")


def declared_examples(value: Any) -> int | None:
    """The training examples a Register request declares (``value``, None: none declared);
    :class:`ValueError` with the reason unless a whole number in 0..2^53."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_EXAMPLES:
        raise ValueError(f"it declares {str(value)[:40]!r} training examples, not a whole number in 0..2^53")
    return value
