"""Who is calling the server: a node's role and id from the call's metadata, its token, its
certificate's name and, but for a registration, its session
(:class:`~fedweave.transports.grpc.server.GrpcServerTransport` composes it).
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, NoReturn

from fedweave.transports.grpc import protocol as p
from fedweave.transports.grpc.certs import hash_token, token_entry
from fedweave.transports.grpc.heartbeats import Heartbeats
from fedweave.transports.serialization import ascii_id

if TYPE_CHECKING:
    from fedweave.config import GrpcConfig

log = logging.getLogger("fedweave.transports.grpc.server")  # one server, one log to follow


def refuse(context: Any, code: Any, why: str) -> NoReturn:
    """End the call with ``code`` and ``why``, logged."""
    log.warning("refused a call from %s: %s", context.peer(), why)
    abort(context, code, why)


def abort(context: Any, code: Any, why: str) -> NoReturn:
    """End the call with ``code`` and ``why`` (gRPC's ``abort`` raises; this says so to a reader and a checker)."""
    context.abort(code, why)
    raise RuntimeError(f"grpc's abort returned: {why}")


class Authenticator:
    """The authenticated node id of a call, or the call refused."""

    def __init__(
        self, grpc: Any, settings: GrpcConfig, role: str, num_nodes: int, nodes: Heartbeats,
        cond: threading.Condition,
    ):
        self._grpc = grpc
        self.settings = settings
        self.role = role
        self.num_nodes = num_nodes
        self._nodes = nodes
        self._cond = cond
        self._tokens = p.token_hashes(settings)

    def authenticate(self, context: Any, registering: bool = False) -> int:
        codes = self._grpc.StatusCode
        metadata = dict(context.invocation_metadata())
        key = p.ROLE_KEYS[self.role]
        (other,) = set(p.ROLE_KEYS.values()) - {key}
        if key not in metadata and other in metadata:
            kind = "site leaders" if self.role == "site" else "clients"
            why = f"{other} {metadata[other]!r}: this server serves {kind} (topology.kind differs from the server's?)"
            refuse(context, codes.UNAUTHENTICATED, why)
        raw = metadata.get(key, "")
        number = ascii_id(raw)
        if number is None or not 0 <= number < self.num_nodes:
            why = f"unknown {self.role} id {str(raw)[:40]!r} ({self.role}s are 0..{self.num_nodes - 1})"
            refuse(context, codes.UNAUTHENTICATED, why)
        node = p.Node(self.role, number)
        cid = node.id
        if self._tokens is not None:
            token, expected = metadata.get(p.TOKEN_KEY), self._tokens.get(token_entry(node.name))
            if token is None or expected is None or not hmac.compare_digest(hash_token(str(token)), expected):
                refuse(context, codes.UNAUTHENTICATED, f"{node}: missing or wrong token")
        if self.settings.tls == "mtls":
            names = [n.decode(errors="replace") for n in context.auth_context().get("x509_common_name", [])]
            if names != [node.name]:
                refuse(context, codes.PERMISSION_DENIED, f"{node}: its certificate belongs to {names}")
        if not registering:
            with self._cond:
                client = self._nodes.nodes.get(cid)
                if client is None or metadata.get(p.SESSION_KEY) != client.session:
                    why = f"{node} is not registered (or was replaced); register again"
                    abort(context, codes.FAILED_PRECONDITION, why)
                client.last_seen = time.monotonic()
        return cid
