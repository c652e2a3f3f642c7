"""The wire between a federation server, its sites and its admins: gRPC over mutual TLS, raw bytes.

Service ``fedweave.v1.Jobs``; every method is unary and carries strict JSON (no protobuf, never
pickle), except that ``Submit`` appends the job's code bundle after its JSON and ``Bundle`` answers
the bundle's bytes:

==========  ======  ==========================================================================
method      caller  what travels
==========  ======  ==========================================================================
Submit      admin   ``u32 length`` + JSON ``{config, bundle_sha256}`` + the bundle's bytes -> ``{job}``
Jobs        admin   ``{}`` -> ``{jobs: [summary...], sites: {name: {...}}}``
Job         admin   ``{job}`` -> the job's record (state, rounds, per-site state, run folder)
Cancel      admin   ``{job}`` -> the job's record
Logs        admin   ``{job, tail}`` -> ``{server: text}``: the end of the job server's log
Poll        site    ``{jobs: {id: report}}`` -> ``{offers, assignments, active}`` (see site.py)
Bundle      site    ``{job}`` -> the bundle's bytes, for a job offered to that site
==========  ======  ==========================================================================

Who calls is read from the peer's verified certificate, never from what the call says: its common
name is ``admin-<name>`` or ``site-<name>`` (:func:`fedweave.transports.grpc.certs.identity_name`), and
the name must be one the federation's file lists. A site calling an admin method is refused with
PERMISSION_DENIED and the reason.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from typing import Any

from fedweave.errors import ConfigError, SerializationError
from fedweave.transports.grpc import certs
from fedweave.transports.grpc.protocol import decode_json, encode_json, grpc_module
from fedweave.transports.serialization import load_json

SERVICE = "fedweave.v1.Jobs"
SUBMIT, JOBS, JOB, CANCEL, LOGS = "Submit", "Jobs", "Job", "Cancel", "Logs"
POLL, BUNDLE = "Poll", "Bundle"
ADMIN_METHODS = (SUBMIT, JOBS, JOB, CANCEL, LOGS)
SITE_METHODS = (POLL, BUNDLE)
ROLE_OF = {**{m: "admin" for m in ADMIN_METHODS}, **{m: "site" for m in SITE_METHODS}}
"""The role a caller's certificate must hold for each method."""

JOB_ID = re.compile(r"job-[0-9]{4,9}")
MAX_JSON_BYTES = 4 << 20
"""The largest JSON part of any message (a job's config, a poll, a list of jobs)."""
LENGTH = struct.Struct(">I")


def method(name: str) -> str:
    return f"/{SERVICE}/{name}"


def check_job_id(value: Any) -> str:
    """``value`` if it is a job id (``job-0001``), else a SerializationError (a peer's malformed call)."""
    if not isinstance(value, str) or not JOB_ID.fullmatch(value):
        raise SerializationError(f"not a job id: {str(value)[:40]!r}")
    return value


def pack_submit(request: dict[str, Any], bundle: bytes | None) -> bytes:
    """A Submit request: the JSON's length, the JSON, the bundle's bytes (none: nothing after the JSON)."""
    body = encode_json(request)
    return LENGTH.pack(len(body)) + body + (bundle or b"")


def unpack_submit(data: bytes) -> tuple[dict[str, Any], bytes | None]:
    """The JSON and the bundle of a Submit request (checked: lengths within the message and the limit)."""
    if len(data) < LENGTH.size:
        raise SerializationError("malformed submission: shorter than its length prefix")
    (length,) = LENGTH.unpack_from(data)
    if length > min(MAX_JSON_BYTES, len(data) - LENGTH.size):
        raise SerializationError(f"malformed submission: its JSON length {length} runs past the message or the limit")
    value = load_json(memoryview(data)[LENGTH.size : LENGTH.size + length], "submission")
    if not isinstance(value, dict):
        raise SerializationError("malformed submission: not a JSON object")
    rest = data[LENGTH.size + length :]
    return value, (bytes(rest) if rest else None)


def decode(data: bytes) -> dict[str, Any]:
    """A message's JSON object (strict; within :data:`MAX_JSON_BYTES`)."""
    if len(data) > MAX_JSON_BYTES:
        raise SerializationError(f"malformed message: {len(data)} bytes of JSON, more than {MAX_JSON_BYTES}")
    return decode_json(data)


def peer_identity(context: Any) -> tuple[str, str] | None:
    """(role, name) of the caller from its verified certificate's common name, or None."""
    names = [n.decode(errors="replace") for n in context.auth_context().get("x509_common_name", [])]
    return certs.parse_identity(names[0]) if len(names) == 1 else None


def message_limit(max_bundle_mb: float) -> int:
    """The gRPC message limit that lets a bundle of ``max_bundle_mb`` MiB and its JSON through."""
    return int(max_bundle_mb * (1 << 20)) + MAX_JSON_BYTES + 1024


def channel(address: str, folder: str, role: str, name: str, limit: int) -> Any:
    """A mutual-TLS channel to the federation at ``address`` as ``<role>-<name>`` (its key pair in ``folder``)."""
    from pathlib import Path

    grpc = grpc_module()
    stem = certs.identity_name(role, name)
    files = {}
    for what, file in (("ca", certs.CA_CERT), ("key", certs.key_file(stem)), ("cert", certs.cert_file(stem))):
        path = Path(folder) / file
        try:
            files[what] = path.read_bytes()
        except OSError as exc:
            raise ConfigError(
                f"config key 'credentials': cannot read {str(path)!r} ({exc.strerror}); create it with "
                f"`fedweave certs --out DIR --{'site-name' if role == 'site' else 'admin'} {name} ...`"
            ) from None
    credentials = grpc.ssl_channel_credentials(files["ca"], files["key"], files["cert"])
    options = [
        ("grpc.max_send_message_length", limit),
        ("grpc.max_receive_message_length", limit),
        ("grpc.enable_retries", 0),
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.min_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]
    return grpc.secure_channel(address, credentials, options=options)


def call(chan: Any, name: str, request: bytes, timeout: float) -> bytes:
    """One unary call of method ``name``; raises grpc.RpcError as gRPC does."""
    stub = chan.unary_unary(method(name), request_serializer=None, response_deserializer=None)
    return bytes(stub(request, timeout=timeout))


def config_digest(config: dict[str, Any]) -> str:
    """The sha256 of a job's config as canonical JSON (what the sites' audit logs record)."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
