"""The binary wire format of a :class:`~fedweave.types.Message`, whole or in chunks.

One message is laid out as::

    offset 0   header (24 bytes, little-endian)
               magic b"FWMS" | version u16 | flags u16 (0) | meta_len u32 | meta_crc32 u32 | data_len u64
    24         metadata: UTF-8 JSON, meta_len bytes (round, client id, the body's scalar
               fields, and per tensor [group, name, dtype, shape, offset, nbytes])
    ...        zero padding up to a multiple of 64
    data_start tensor bytes; each tensor starts at a multiple of 64 after data_start,
               in the order listed, with zero padding between them; data_len bytes

Tensors are stored raw and little-endian, C-contiguous, in their own dtype (fp32, fp16,
bf16, fp64, int8, int32, int64, uint8, bool). The receiver validates everything before
it builds anything: magic, version, sizes against a configurable maximum, the
metadata's checksum and schema, every name, dtype, shape and offset, and, when it is
given the names and shapes it expects, that the tensors match them. Any problem is a
:class:`~fedweave.errors.SerializationError` (``PayloadTooLarge`` for sizes,
``PayloadMismatch`` for unexpected tensors); a message is returned whole or not at all.

Zero copy: :func:`iter_chunks` slices the tensors' own memory (no copy of the model
is made to send it); :func:`decode` of a writable buffer returns tensors that are views
into it (``torch.frombuffer``); :class:`StreamDecoder` copies each incoming chunk once,
straight into the final tensor, so a receiver holds the payload plus one chunk.

For streaming transports, :func:`encode_frames` wraps each ~1 MiB chunk in a 20-byte
frame (kind, flags, sequence number, CRC-32 of the chunk, offset) and
:class:`FrameDecoder` checks each frame (order, size, checksum) before feeding it to
a :class:`StreamDecoder`. No frame holds the whole message, so a message of any size
(also over 2 GB) travels as a bounded stream.

A :class:`~fedweave.types.Control` body (a step of a plugin's own protocol, such as
secure aggregation's key set-up) carries its plugin and step names, checked to be short
identifiers, and one group of tensors, which its plugin checks.

Site batches: a :class:`SiteJob` (a gRPC site leader's round: every member's instruction,
or every member's control step) and a :class:`SiteReply` (the members' updates,
evaluations or control answers, or one pre-aggregated update, and each failed member's
reason) are one message each. Their metadata lists the
inner messages (``items``: client id, body kind, fields, and per tensor group a name ->
pool index map); their tensors are a ``pool`` in which a tensor shared by several inner
messages (the global model every member receives) travels once. Decoding checks every
item as a message of its own, every pool index, that every pooled tensor is used, and
that each item belongs to the batch's round.
"""

from __future__ import annotations

import dataclasses
import json
import math
import mmap
import re
import struct
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fedweave.errors import PayloadMismatch, PayloadTooLarge, SerializationError
from fedweave.types import Control, Evaluation, Instruction, Message, TaskKind, Update, UpdateKind, Work

MAGIC = b"FWMS"
VERSION = 2
"""2: updates name the clients behind them (``members``); site-job, site-reply and control bodies."""
HEADER = struct.Struct("<4sHHIIQ")
ALIGN = 64
CHUNK_BYTES = 1 << 20
MAX_META_BYTES = 64 << 20
MAX_INT = (1 << 63) - 1
"""The largest integer metadata may hold (int64): every count, id, shape and size fits a C long."""
MAX_NDIM = 64
MAX_ELEMENTS = 1 << 62
"""The most elements a tensor's shape may span, zero dimensions counted as one (strides fit int64)."""

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int8": torch.int8,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.:-]{0,99}")
"""A control message's plugin and step: a short identifier."""

# The tensor groups of each body, the first being the one checked against ``expected``.
_GROUPS = {
    "instruction": ("params", "extras"),
    "update": ("tensors", "extras"),
    "evaluation": (),
    "control": ("tensors",),
}
_BATCHES = {"site_job": ("instruction", "control"), "site_reply": ("update", "evaluation", "control")}
"""Site batch bodies and the inner bodies each may hold; their tensors are one ``pool`` group."""
_GROUPS.update(dict.fromkeys(_BATCHES, ("pool",)))

Expected = Mapping[str, Sequence[int]]
"""Tensor name -> shape a receiver expects (a sent update may carry a subset)."""

try:  # the same CRC-32 as zlib's, about 3x faster (carry-less multiply); installed by the grpc extra
    from isal.isal_zlib import crc32 as chunk_crc32
except ImportError:
    chunk_crc32 = zlib.crc32

HUGE_PAGE_BYTES = 4 << 20
"""A streamed message with at least this much tensor data is received into one anonymous
mapping advised for transparent huge pages: filling fresh memory is dominated by page
faults, and 2 MiB pages cut them 512-fold (a fresh 100 MB receive runs ~2.5x faster)."""


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass
class SiteJob:
    """Server to a site leader: one round's instructions (or control steps of a plugin's own
    protocol) for the site's members (client ids), and the seconds the server waits for the
    answer (None: no deadline)."""

    messages: list[Message]
    timeout: float | None = None


@dataclass
class SiteReply:
    """A site leader to the server: its members' replies (updates, evaluations, control answers;
    or one pre-aggregated update standing for ``clients`` of them, named in its ``members``) and
    each failed member's reason."""

    messages: list[Message]
    failures: dict[int, str] = field(default_factory=dict)


# --------------------------------------------------------------------------- encoding


@dataclass
class _Plan:
    """A message laid out: the header and metadata bytes, then (offset, bytes) per tensor."""

    head: bytes  # header + metadata + padding up to data_start
    tensors: list[tuple[int, memoryview]]  # offset in the data section, raw bytes
    data_len: int

    @property
    def total(self) -> int:
        return len(self.head) + self.data_len


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of ``t`` without a copy when it is a contiguous CPU tensor."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _body_fields(body: Any) -> tuple[str, dict[str, Any], dict[str, Mapping[str, torch.Tensor]]]:
    if isinstance(body, Instruction):
        w = body.work
        fields = {
            "task": body.task.value,
            "work": {
                "client_id": w.client_id,
                "batch_size": w.batch_size,
                "epochs": w.epochs,
                "local_steps": w.local_steps,
            },
            "config": body.config,
            "applied": list(body.applied),
        }
        return "instruction", fields, {"params": body.params, "extras": body.extras}
    if isinstance(body, Update):
        fields = {
            "kind": body.kind.value,
            "num_examples": body.num_examples,
            "metrics": body.metrics,
            "applied": list(body.applied),
            "client_id": body.client_id,
            "local_steps": body.local_steps,
            "compute_time": body.compute_time,
            "clients": body.clients,
            "members": list(body.members),
        }
        return "update", fields, {"tensors": body.tensors, "extras": body.extras}
    if isinstance(body, Evaluation):
        fields = {"num_examples": body.num_examples, "metrics": body.metrics, "client_id": body.client_id}
        return "evaluation", fields, {}
    if isinstance(body, Control):
        return "control", {"plugin": body.plugin, "step": body.step}, {"tensors": body.tensors}
    if isinstance(body, (SiteJob, SiteReply)):
        return _batch_fields(body)
    raise SerializationError(f"cannot serialize a message body of type {type(body).__name__}")


def _batch_fields(body: SiteJob | SiteReply) -> tuple[str, dict[str, Any], dict[str, Mapping[str, torch.Tensor]]]:
    """A site batch: its messages as items whose tensors index a pool (each shared tensor once)."""
    kind = "site_job" if isinstance(body, SiteJob) else "site_reply"
    pool: dict[int, tuple[int, torch.Tensor]] = {}
    items = []
    for m in body.messages:
        inner, fields, groups = _body_fields(m.body)
        if inner not in _BATCHES[kind]:
            raise SerializationError(f"a {kind} cannot hold a message of kind {inner!r} (only {', '.join(_BATCHES[kind])})")
        refs: dict[str, dict[str, int]] = {}
        for group, named in groups.items():
            refs[group] = {}
            for name, t in named.items():
                refs[group][name] = pool.setdefault(id(t), (len(pool), t))[0]
        items.append({"round": m.round, "client_id": m.client_id, "body": inner, "fields": fields, "tensors": refs})
    extra: dict[str, Any] = (
        {"timeout": body.timeout}
        if isinstance(body, SiteJob)
        else {"failures": {str(c): str(why) for c, why in body.failures.items()}}
    )
    return kind, {"items": items, **extra}, {"pool": {str(i): t for i, t in pool.values()}}


def _plan(message: Message) -> _Plan:
    kind, fields, groups = _body_fields(message.body)
    entries, tensors, offset = [], [], 0
    for group, named in groups.items():
        for name, t in named.items():
            if not isinstance(t, torch.Tensor):
                raise SerializationError(f"{group} {name!r} is a {type(t).__name__}, not a tensor")
            dtype = _NAMES.get(t.dtype)
            if dtype is None:
                raise SerializationError(
                    f"{group} {name!r} has dtype {t.dtype}, which the wire format does not carry "
                    f"(supported: {', '.join(DTYPES)})"
                )
            raw = _raw(t)
            offset = _align(offset)
            entries.append([group, name, dtype, list(t.shape), offset, len(raw)])
            tensors.append((offset, raw))
            offset += len(raw)
    meta = {"round": message.round, "client_id": message.client_id, "body": kind, "fields": fields, "tensors": entries}
    try:
        meta_bytes = json.dumps(meta, separators=(",", ":")).encode()
    except (TypeError, ValueError) as exc:
        raise SerializationError(f"message metadata is not JSON-serializable: {exc}") from None
    header = HEADER.pack(MAGIC, VERSION, 0, len(meta_bytes), zlib.crc32(meta_bytes), offset)
    head = header + meta_bytes
    head += bytes(_align(len(head)) - len(head))
    return _Plan(head, tensors, offset)


def encoded_size(message: Message) -> int:
    """Bytes of the encoded message (without building it)."""
    return _plan(message).total


def encode(message: Message) -> bytearray:
    """The whole message in one buffer (each tensor copied once)."""
    plan = _plan(message)
    out = bytearray(plan.total)
    out[: len(plan.head)] = plan.head
    start = len(plan.head)
    for offset, raw in plan.tensors:
        out[start + offset : start + offset + len(raw)] = raw
    return out


def _pieces(plan: _Plan) -> Iterator[memoryview]:
    yield memoryview(plan.head)
    position = 0
    for offset, raw in plan.tensors:
        if offset > position:
            yield memoryview(bytes(offset - position))
        if len(raw):
            yield raw
        position = offset + len(raw)


def iter_chunks(message: Message, chunk_bytes: int = CHUNK_BYTES) -> Iterator[memoryview | bytearray]:
    """The encoded message as consecutive chunks of ``chunk_bytes`` (the last may be shorter).

    A chunk inside one large tensor is a view of the tensor's memory (no copy); small
    pieces are gathered into a fresh buffer. A consumer must use (or copy) each chunk
    before the tensors change.
    """
    if chunk_bytes < 1:
        raise ValueError("chunk_bytes must be positive")
    return _coalesce(_pieces(_plan(message)), chunk_bytes)


def _coalesce(pieces: Iterable[memoryview], size: int) -> Iterator[memoryview | bytearray]:
    buf = bytearray()
    for mv in pieces:
        pos, n = 0, len(mv)
        while pos < n:
            if not buf and n - pos >= size:
                yield mv[pos : pos + size]
                pos += size
                continue
            take = min(size - len(buf), n - pos)
            buf += mv[pos : pos + take]
            pos += take
            if len(buf) == size:
                yield buf
                buf = bytearray()
    if buf:
        yield buf


# --------------------------------------------------------------------------- decoding


@dataclass(frozen=True)
class _Tensor:
    group: str
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass
class _Layout:
    round: int
    client_id: int
    body: str
    fields: dict[str, Any]
    tensors: list[_Tensor]
    data_start: int
    data_len: int
    # a site batch's items once checked (see _items): each item's own layout and pool index map
    items: list[tuple[_Layout, dict[str, dict[str, int]]]] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.data_start + self.data_len


def _header(buf: bytes | memoryview, max_bytes: int | None) -> tuple[int, int, int]:
    """Check the fixed header; return (meta_len, meta_crc, data_len)."""
    if len(buf) < HEADER.size:
        raise SerializationError(f"truncated message: {len(buf)} bytes, shorter than the {HEADER.size}-byte header")
    magic, version, flags, meta_len, meta_crc, data_len = HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise SerializationError(f"not a fedweave message: magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise SerializationError(f"message format version {version} is not supported (this fedweave reads {VERSION})")
    if flags != 0:
        raise SerializationError(f"message header has unknown flags {flags:#x}")
    if meta_len > MAX_META_BYTES:
        raise PayloadTooLarge(f"message metadata of {meta_len} bytes exceeds the {MAX_META_BYTES}-byte limit")
    total = _align(HEADER.size + meta_len) + data_len
    if total > MAX_INT:
        raise PayloadTooLarge(f"message of {total} bytes exceeds any size this machine can hold")
    if max_bytes is not None and total > max_bytes:
        raise PayloadTooLarge(f"message of {total} bytes exceeds the maximum of {max_bytes} bytes")
    return meta_len, meta_crc, data_len


def _is_int(v: Any, low: int | None = None) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and (low is None or v >= low)


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise SerializationError(f"malformed message metadata: {what}")


def _json_int(text: str) -> int:
    # at most 19 digits and a sign: int() never sees a huge literal, and the value fits int64
    _check(len(text.lstrip("-")) <= 19 and abs(int(text)) <= MAX_INT, f"integer {text[:30]} is out of range")
    return int(text)


def _json_float(text: str) -> float:
    value = float(text)
    _check(math.isfinite(value), f"number {text[:30]} is out of range")
    return value


def _json_constant(text: str) -> float:
    raise SerializationError(f"malformed message metadata: {text} is not a number JSON allows")


def load_json(data: bytes | memoryview, what: str) -> Any:
    """Strict JSON of a peer: UTF-8, integers within int64, finite floats (no NaN or Infinity),
    nesting within the interpreter's recursion limit; anything else is a SerializationError."""
    try:
        return json.loads(
            bytes(data).decode("utf-8"),
            parse_int=_json_int,
            parse_float=_json_float,
            parse_constant=_json_constant,
        )
    except RecursionError:
        raise SerializationError(f"malformed {what}: JSON nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise SerializationError(f"malformed {what}: not UTF-8 JSON ({exc})") from None


def ascii_id(text: Any) -> int | None:
    """A node id written by a peer: ASCII digits only (not "²" or "٥"), within int64; else None."""
    if not isinstance(text, str) or not 0 < len(text) <= 18 or not text.isascii() or not text.isdigit():
        return None
    return int(text)


def _shape_ok(shape: Any) -> bool:
    if not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(_is_int(s, 0) for s in shape):
        return False
    return math.prod(max(s, 1) for s in shape) <= MAX_ELEMENTS


def _scalars(d: Any, what: str) -> dict[str, float]:
    _check(isinstance(d, dict), f"{what} is not a mapping")
    for k, v in d.items():
        _check(isinstance(v, (int, float)) and not isinstance(v, bool), f"{what}[{k!r}] is not a number")
    return {k: float(v) for k, v in d.items()}


def _names(v: Any, what: str) -> list[str]:
    _check(isinstance(v, list) and all(isinstance(x, str) for x in v), f"{what} is not a list of names")
    return list(v)


_FIELDS = {
    "instruction": {"task", "work", "config", "applied"},
    "update": {
        "kind", "num_examples", "metrics", "applied", "client_id", "local_steps", "compute_time", "clients", "members"
    },
    "evaluation": {"num_examples", "metrics", "client_id"},
    "control": {"plugin", "step"},
    "site_job": {"items", "timeout"},
    "site_reply": {"items", "failures"},
}


def _layout(meta_bytes: bytes | memoryview, meta_crc: int, data_len: int, expected: Expected | None) -> _Layout:
    if zlib.crc32(meta_bytes) != meta_crc:
        raise SerializationError("corrupted message: the metadata checksum does not match")
    meta = load_json(meta_bytes, "message metadata")
    _check(isinstance(meta, dict), "not a mapping")
    _check(set(meta) == {"round", "client_id", "body", "fields", "tensors"}, f"unexpected keys {sorted(meta)}")
    _check(_is_int(meta["round"], 0), "round is not a non-negative integer")
    _check(_is_int(meta["client_id"], -1), "client_id is not an integer >= -1")
    body = meta["body"]
    _check(isinstance(body, str) and body in _GROUPS, f"unknown body {body!r}")
    fields = meta["fields"]
    _check(isinstance(fields, dict) and set(fields) == _FIELDS[body], f"{body} fields are not {sorted(_FIELDS[body])}")
    entries = meta["tensors"]
    _check(isinstance(entries, list), "tensors is not a list")
    tensors, seen, end = [], set(), 0
    for i, e in enumerate(entries):
        _check(isinstance(e, list) and len(e) == 6, f"tensor entry {i} is not [group, name, dtype, shape, offset, nbytes]")
        group, name, dtype_name, shape, offset, nbytes = e
        _check(isinstance(group, str) and group in _GROUPS[body], f"tensor {i}: group {group!r} is not one of {list(_GROUPS[body])}")
        _check(isinstance(name, str), f"tensor {i}: name is not a string")
        _check((group, name) not in seen, f"tensor {name!r} appears twice in {group}")
        seen.add((group, name))
        _check(isinstance(dtype_name, str) and dtype_name in DTYPES, f"tensor {name!r}: unknown dtype {dtype_name!r}")
        _check(_shape_ok(shape), f"tensor {name!r}: bad shape {shape!r}")
        dtype = DTYPES[dtype_name]
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        _check(
            _is_int(nbytes) and nbytes == size,
            f"tensor {name!r}: {nbytes!r} bytes, but shape {shape} of {dtype_name} needs {size}",
        )
        _check(_is_int(offset) and offset == _align(end), f"tensor {name!r}: offset {offset!r} is not {_align(end)}")
        end = offset + nbytes
        tensors.append(_Tensor(group, name, dtype, tuple(shape), offset, nbytes))
    if end != data_len:
        raise SerializationError(f"malformed message: tensors end at byte {end} of a {data_len}-byte data section")
    layout = _Layout(
        meta["round"], meta["client_id"], body, fields, tensors, _align(HEADER.size + len(meta_bytes)), data_len
    )
    _check_fields(layout)
    if expected is not None:
        _check_expected(layout, expected)
    return layout


def _check_fields(layout: _Layout) -> None:
    f = layout.fields
    if layout.body in _BATCHES:
        _check_batch(layout)
        return
    if layout.body == "control":
        for key in ("plugin", "step"):
            _check(isinstance(f[key], str) and _NAME.fullmatch(f[key]) is not None, f"control {key} {f[key]!r} is not a name")
        return
    if layout.body == "instruction":
        _check(isinstance(f["task"], str) and f["task"] in {t.value for t in TaskKind}, f"unknown task {f['task']!r}")
        w = f["work"]
        _check(isinstance(w, dict) and set(w) == {"client_id", "batch_size", "epochs", "local_steps"}, "bad work")
        _check(_is_int(w["client_id"], 0) and _is_int(w["batch_size"], 1) and _is_int(w["epochs"], 0), "bad work")
        _check(w["local_steps"] is None or _is_int(w["local_steps"], 0), "bad work.local_steps")
        _check(isinstance(f["config"], dict), "config is not a mapping")
        _names(f["applied"], "applied")
    else:
        _check(_is_int(f["num_examples"], 0), "num_examples is not a non-negative integer")
        _scalars(f["metrics"], "metrics")
        _check(_is_int(f["client_id"], -1), "client_id is not an integer")
    if layout.body == "update":
        _check(isinstance(f["kind"], str) and f["kind"] in {k.value for k in UpdateKind}, f"unknown update kind {f['kind']!r}")
        _names(f["applied"], "applied")
        _check(_is_int(f["local_steps"], 0), "local_steps is not a non-negative integer")
        _check(isinstance(f["compute_time"], (int, float)) and not isinstance(f["compute_time"], bool), "bad compute_time")
        _check(_is_int(f["clients"], 1), "clients is not a positive integer")
        members = f["members"]
        _check(
            isinstance(members, list) and all(_is_int(m, 0) for m in members) and len(members) in (0, f["clients"]),
            "members is not a list of one client id per client of the update (or empty)",
        )


def _items(layout: _Layout) -> list[tuple[_Layout, dict[str, dict[str, int]]]]:
    """A checked site batch's items, each as the layout of a message of its own (tensors taken from
    the pool) and its group -> name -> pool index map."""
    pool = {t.name: t for t in layout.tensors}
    out = []
    for item in layout.fields["items"]:
        tensors = [
            dataclasses.replace(pool[str(i)], group=group, name=name)
            for group, named in item["tensors"].items()
            for name, i in named.items()
        ]
        inner = _Layout(item["round"], item["client_id"], item["body"], item["fields"], tensors, 0, 0)
        out.append((inner, item["tensors"]))
    return out


def _check_batch(layout: _Layout) -> None:
    f = layout.fields
    pool = layout.tensors
    _check([t.name for t in pool] == [str(i) for i in range(len(pool))], "pool tensors are not named 0..n-1 in order")
    items = f["items"]
    _check(isinstance(items, list), "items is not a list")
    used: set[int] = set()
    ids: set[int] = set()
    for n, item in enumerate(items):
        _check(
            isinstance(item, dict) and set(item) == {"round", "client_id", "body", "fields", "tensors"},
            f"item {n} is not a mapping of round, client_id, body, fields, tensors",
        )
        _check(_is_int(item["round"]) and item["round"] == layout.round, f"item {n} is for round {item['round']!r}, the batch for {layout.round}")
        cid, kind = item["client_id"], item["body"]
        _check(_is_int(cid, 0) and cid not in ids, f"item {n}: client_id {cid!r} is not a new non-negative integer")
        ids.add(cid)
        _check(isinstance(kind, str) and kind in _BATCHES[layout.body], f"item {n}: a {layout.body} cannot hold a message of kind {kind!r}")
        fields, refs = item["fields"], item["tensors"]
        _check(isinstance(fields, dict) and set(fields) == _FIELDS[kind], f"item {n}: {kind} fields are not {sorted(_FIELDS[kind])}")
        _check(isinstance(refs, dict) and set(refs) <= set(_GROUPS[kind]), f"item {n}: tensor groups are not of {_GROUPS[kind]}")
        for group, named in refs.items():
            _check(isinstance(named, dict), f"item {n}: {group} is not a mapping of names to pool indices")
            for name, i in named.items():
                _check(_is_int(i, 0) and i < len(pool), f"item {n}: {group} {name!r} names no pool tensor ({i!r})")
                used.add(i)
    _check(used == set(range(len(pool))), "a pool tensor is used by no item")
    layout.items = _items(layout)
    for inner, _ in layout.items:
        _check_fields(inner)
    if layout.body == "site_job":
        t = f["timeout"]
        _check(t is None or (isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0), "timeout is not positive")
    else:
        failures = f["failures"]
        _check(isinstance(failures, dict), "failures is not a mapping")
        for c, why in failures.items():
            cid = ascii_id(c)
            _check(cid is not None and cid not in ids and isinstance(why, str), f"failure {c!r} is not a reason of another client")
            ids.add(cid)


def _check_expected(layout: _Layout, expected: Expected) -> None:
    """The primary tensors (params / update tensors) must be known names of the expected shapes.

    Only checked when no plugin was applied: an encoded payload (compressed, masked)
    legitimately carries other names and shapes, which its plugin's decode checks.
    """
    if layout.body in _BATCHES:
        for inner, _ in layout.items:
            _check_expected(inner, expected)
        return
    groups = _GROUPS[layout.body]
    if not groups or layout.body == "control" or layout.fields["applied"]:
        return
    for t in layout.tensors:
        if t.group != groups[0]:
            continue
        if t.name not in expected:
            raise PayloadMismatch(f"unexpected tensor {t.name!r} (not a parameter of this model)")
        shape = tuple(expected[t.name])
        if t.shape != shape:
            raise PayloadMismatch(f"tensor {t.name!r} has shape {list(t.shape)}, expected {list(shape)}")


def _check_bool(t: torch.Tensor, name: str) -> None:
    if t.dtype == torch.bool and t.numel() and int(t.view(torch.uint8).max()) > 1:
        raise SerializationError(f"corrupted message: bool tensor {name!r} holds bytes other than 0 and 1")


def _build(layout: _Layout, values: dict[tuple[str, str], torch.Tensor]) -> Message:
    f = layout.fields
    if layout.body in _BATCHES:
        messages = [
            _build(inner, {(g, name): values[("pool", str(i))] for g, named in refs.items() for name, i in named.items()})
            for inner, refs in layout.items
        ]
        if layout.body == "site_job":
            return Message(layout.round, layout.client_id, SiteJob(messages, f["timeout"]))
        failures = {int(c): why for c, why in f["failures"].items()}
        return Message(layout.round, layout.client_id, SiteReply(messages, failures))
    groups: dict[str, dict[str, torch.Tensor]] = {g: {} for g in _GROUPS[layout.body]}
    for t in layout.tensors:
        value = values[(t.group, t.name)]
        _check_bool(value, t.name)
        groups[t.group][t.name] = value
    body: Any
    if layout.body == "instruction":
        w = f["work"]
        body = Instruction(
            round=layout.round,
            task=TaskKind(f["task"]),
            work=Work(w["client_id"], w["batch_size"], w["epochs"], w["local_steps"]),
            params=groups["params"],
            config=f["config"],
            extras=groups["extras"],
            applied=list(f["applied"]),
        )
    elif layout.body == "update":
        body = Update(
            kind=UpdateKind(f["kind"]),
            tensors=groups["tensors"],
            num_examples=f["num_examples"],
            metrics=_scalars(f["metrics"], "metrics"),
            extras=groups["extras"],
            applied=list(f["applied"]),
            client_id=f["client_id"],
            local_steps=f["local_steps"],
            compute_time=float(f["compute_time"]),
            clients=f["clients"],
            members=list(f["members"]),
        )
    elif layout.body == "control":
        body = Control(plugin=f["plugin"], step=f["step"], tensors=groups["tensors"])
    else:
        metrics = _scalars(f["metrics"], "metrics")
        body = Evaluation(num_examples=f["num_examples"], metrics=metrics, client_id=f["client_id"])
    return Message(layout.round, layout.client_id, body)


def _empty(t: _Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype)


def receive_region(nbytes: int) -> mmap.mmap | None:
    """Fresh memory for a large message's tensor data (see :data:`HUGE_PAGE_BYTES`), else None."""
    if nbytes < HUGE_PAGE_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    return region


def _view(region: mmap.mmap, t: _Tensor) -> torch.Tensor:
    """Tensor ``t`` as a view of its bytes in ``region`` (the tensor keeps the region alive)."""
    return torch.frombuffer(region, dtype=torch.uint8, count=t.nbytes, offset=t.offset).view(t.dtype).view(t.shape)


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A writable uint8 view of a fresh contiguous tensor's memory."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def decode(
    buffer: bytes | bytearray | memoryview,
    *,
    max_bytes: int | None = None,
    expected: Expected | None = None,
    copy: bool | None = None,
) -> Message:
    """The message in ``buffer``, which must hold exactly one encoded message.

    With ``copy=None`` (default) the tensors are views into ``buffer`` when it is
    writable (a ``bytearray``, a writable ``memoryview``, an ``mmap``) and their data
    is suitably aligned: no bytes are copied and the tensors keep the buffer alive.
    A read-only buffer (``bytes``) is copied, so the tensors are always writable.
    ``copy=True`` always copies; ``copy=False`` refuses a read-only buffer.
    """
    mv = memoryview(buffer)
    if mv.ndim != 1 or mv.itemsize != 1:
        mv = mv.cast("B")
    if copy is False and mv.readonly:
        raise ValueError("decode(copy=False) needs a writable buffer")
    zero_copy = not mv.readonly if copy is None else not copy
    meta_len, meta_crc, data_len = _header(mv, max_bytes)
    if len(mv) < HEADER.size + meta_len:
        raise SerializationError(f"truncated message: {len(mv)} bytes, the metadata alone needs {HEADER.size + meta_len}")
    layout = _layout(mv[HEADER.size : HEADER.size + meta_len], meta_crc, data_len, expected)
    if len(mv) != layout.total:
        what = "truncated" if len(mv) < layout.total else "malformed"
        raise SerializationError(f"{what} message: {len(mv)} bytes, the header declares {layout.total}")
    values = {}
    for t in layout.tensors:
        start = layout.data_start + t.offset
        region = mv[start : start + t.nbytes]
        if t.nbytes == 0:
            value = _empty(t)
        elif zero_copy:
            raw = torch.frombuffer(region, dtype=torch.uint8)
            itemsize = torch.empty((), dtype=t.dtype).element_size()
            if raw.data_ptr() % itemsize:  # unaligned for this dtype: copy rather than view
                raw = raw.clone()
            value = raw.view(t.dtype).view(t.shape)
        else:
            value = _empty(t)
            _bytes_of(value)[:] = region
        values[(t.group, t.name)] = value
    return _build(layout, values)


class StreamDecoder:
    """Decodes one message from consecutive chunks of any sizes.

    The header and metadata are checked as soon as they are complete, before any
    tensor is allocated (so an oversized or unexpected message costs nothing); then
    every tensor is allocated once and each chunk is copied straight into it.
    :meth:`finish` returns the message, or raises if it is incomplete.
    """

    def __init__(self, *, max_bytes: int | None = None, expected: Expected | None = None):
        self.max_bytes = max_bytes
        self.expected = expected
        self.received = 0
        self._head = bytearray()
        self._head_len: int | None = None  # header + metadata + padding, once known
        self._layout: _Layout | None = None
        self._targets: list[tuple[int, int, memoryview]] = []  # absolute start, end, destination
        self._values: dict[tuple[str, str], torch.Tensor] = {}
        self._next = 0  # index into _targets

    @property
    def total(self) -> int | None:
        """The message's declared size, once its header has arrived."""
        return None if self._layout is None else self._layout.total

    @property
    def complete(self) -> bool:
        return self._layout is not None and self.received == self._layout.total

    def feed(self, chunk: bytes | bytearray | memoryview) -> None:
        mv = memoryview(chunk)
        if mv.ndim != 1 or mv.itemsize != 1:
            mv = mv.cast("B")
        while len(mv):
            if self._layout is None:
                mv = self._feed_head(mv)
                continue
            if self.received + len(mv) > self._layout.total:
                raise SerializationError(
                    f"malformed message: more bytes than the {self._layout.total} its header declares"
                )
            self._feed_data(mv)
            self.received += len(mv)
            return

    def _feed_head(self, mv: memoryview) -> memoryview:
        need = HEADER.size if self._head_len is None else self._head_len
        take = min(need - len(self._head), len(mv))
        self._head += mv[:take]
        self.received += take
        if self._head_len is None and len(self._head) == HEADER.size:
            meta_len, _, _ = _header(self._head, self.max_bytes)
            self._head_len = _align(HEADER.size + meta_len)
        if self._head_len is not None and len(self._head) == self._head_len:
            meta_len, meta_crc, data_len = _header(self._head, self.max_bytes)
            meta = memoryview(self._head)[HEADER.size : HEADER.size + meta_len]
            layout = _layout(meta, meta_crc, data_len, self.expected)
            meta.release()
            try:
                region = receive_region(layout.data_len)
                values = [_empty(t) if region is None or not t.nbytes else _view(region, t) for t in layout.tensors]
            except (OSError, MemoryError, RuntimeError) as exc:  # mmap's ENOMEM, torch's failed allocation
                raise PayloadTooLarge(f"cannot allocate the {layout.data_len} bytes the message declares: {exc}") from None
            for t, value in zip(layout.tensors, values):
                self._values[(t.group, t.name)] = value
                if t.nbytes:
                    start = layout.data_start + t.offset
                    self._targets.append((start, start + t.nbytes, _bytes_of(value)))
            self._layout = layout
            self._head = bytearray()
        return mv[take:]

    def _feed_data(self, mv: memoryview) -> None:
        base = position = self.received
        end = base + len(mv)
        while self._next < len(self._targets) and position < end:
            start, stop, dest = self._targets[self._next]
            if stop <= position:
                self._next += 1
                continue
            if start >= end:
                return
            lo, hi = max(start, position), min(stop, end)
            dest[lo - start : hi - start] = mv[lo - base : hi - base]
            if hi == stop:
                self._next += 1
            position = hi

    def finish(self) -> Message:
        if self._layout is None:
            raise SerializationError(f"truncated message: {self.received} bytes, the header and metadata are incomplete")
        if not self.complete:
            raise SerializationError(f"truncated message: {self.received} of {self._layout.total} bytes arrived")
        message = _build(self._layout, self._values)
        self._values, self._targets = {}, []
        return message


# --------------------------------------------------------------------------- frames


FRAME = struct.Struct("<BBHIIQ")
"""kind u8 | flags u8 | reserved u16 | seq u32 | crc32 u32 | offset u64 (then the chunk)."""
DATA = 1
FLAG_CRC = 1


def encode_frames(message: Message, chunk_bytes: int = CHUNK_BYTES, checksum: bool = True) -> Iterator[bytes]:
    """The message as DATA frames of at most ``chunk_bytes`` payload each (one copy per chunk)."""
    offset = 0
    for seq, chunk in enumerate(iter_chunks(message, chunk_bytes)):
        crc = chunk_crc32(chunk) if checksum else 0
        yield b"".join((FRAME.pack(DATA, FLAG_CRC if checksum else 0, 0, seq, crc, offset), chunk))
        offset += len(chunk)


class FrameDecoder:
    """Checks DATA frames (order, size, checksum) and feeds them to a :class:`StreamDecoder`."""

    def __init__(
        self,
        *,
        max_chunk_bytes: int = CHUNK_BYTES,
        max_bytes: int | None = None,
        expected: Expected | None = None,
        require_checksum: bool = False,
    ):
        self.max_chunk_bytes = max_chunk_bytes
        self.require_checksum = require_checksum
        self.stream = StreamDecoder(max_bytes=max_bytes, expected=expected)
        self.seq = 0

    def feed(self, frame: bytes | bytearray | memoryview) -> None:
        mv = memoryview(frame)
        if len(mv) < FRAME.size:
            raise SerializationError(f"corrupted chunk {self.seq}: {len(mv)} bytes, shorter than a frame header")
        kind, flags, _, seq, crc, offset = FRAME.unpack_from(mv)
        payload = mv[FRAME.size :]
        if kind != DATA:
            raise SerializationError(f"corrupted chunk {self.seq}: frame kind {kind} is not a data frame")
        if len(payload) > self.max_chunk_bytes:
            raise PayloadTooLarge(
                f"chunk {seq} of {len(payload)} bytes exceeds the maximum chunk of {self.max_chunk_bytes} bytes"
            )
        if seq != self.seq or offset != self.stream.received:
            raise SerializationError(
                f"corrupted stream: chunk {seq} at byte {offset} arrived where chunk {self.seq} at byte "
                f"{self.stream.received} was due"
            )
        if flags & FLAG_CRC:
            if chunk_crc32(payload) != crc:
                raise SerializationError(f"corrupted chunk {seq}: CRC-32 mismatch")
        elif self.require_checksum:
            raise SerializationError(f"chunk {seq} carries no checksum, which this receiver requires")
        self.stream.feed(payload)
        self.seq += 1

    @property
    def complete(self) -> bool:
        return self.stream.complete

    def finish(self) -> Message:
        return self.stream.finish()
