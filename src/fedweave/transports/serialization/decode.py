"""Decoding: the header and metadata checked into a layout, the message built from it, and
the memory a large message is received into."""

from __future__ import annotations

import dataclasses
import math
import mmap
import re
import zlib
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from fedweave.errors import PayloadMismatch, PayloadTooLarge, SerializationError
from fedweave.transports.serialization.format import (
    BATCHES,
    DTYPES,
    GROUPS,
    HEADER,
    MAGIC,
    MAX_ELEMENTS,
    MAX_INT,
    MAX_META_BYTES,
    MAX_NDIM,
    VERSION,
    Expected,
    align,
)
from fedweave.transports.serialization.strict_json import ascii_id, check, load_json
from fedweave.types import Control, Evaluation, Instruction, Message, SiteJob, SiteReply, TaskKind, Update, UpdateKind, Work

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.:-]{0,99}")
"""A control message's plugin and step: a short identifier."""

HUGE_PAGE_BYTES = 4 << 20
"""A streamed message with at least this much tensor data is received into one anonymous
mapping advised for transparent huge pages: filling fresh memory is dominated by page
faults, and 2 MiB pages cut them 512-fold (a fresh 100 MB receive runs ~2.5x faster)."""


@dataclass(frozen=True)
class _Tensor:
    group: str
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass
class Layout:
    round: int
    client_id: int
    body: str
    fields: dict[str, Any]
    tensors: list[_Tensor]
    data_start: int
    data_len: int
    # a site batch's items once checked (see _items): each item's own layout and pool index map
    items: list[tuple[Layout, dict[str, dict[str, int]]]] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.data_start + self.data_len


def read_header(buf: bytes | bytearray | memoryview, max_bytes: int | None) -> tuple[int, int, int]:
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
    total = align(HEADER.size + meta_len) + data_len
    if total > MAX_INT:
        raise PayloadTooLarge(f"message of {total} bytes exceeds any size this machine can hold")
    if max_bytes is not None and total > max_bytes:
        raise PayloadTooLarge(f"message of {total} bytes exceeds the maximum of {max_bytes} bytes")
    return meta_len, meta_crc, data_len


def _is_int(v: Any, low: int | None = None) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and (low is None or v >= low)


def _shape_ok(shape: Any) -> bool:
    if not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(_is_int(s, 0) for s in shape):
        return False
    return math.prod(max(s, 1) for s in shape) <= MAX_ELEMENTS


def _scalars(d: Any, what: str) -> dict[str, float]:
    check(isinstance(d, dict), f"{what} is not a mapping")
    for k, v in d.items():
        check(isinstance(v, (int, float)) and not isinstance(v, bool), f"{what}[{k!r}] is not a number")
    return {k: float(v) for k, v in d.items()}


def _names(v: Any, what: str) -> list[str]:
    check(isinstance(v, list) and all(isinstance(x, str) for x in v), f"{what} is not a list of names")
    return list(v)


_FIELDS = {
    "instruction": {"task", "work", "config", "applied"},
    "update": {
        "kind", "num_examples", "metrics", "applied", "client_id", "local_steps", "compute_time", "clients", "members"
    },
    "evaluation": {"num_examples", "metrics", "client_id"},
    "control": {"plugin", "step"},
    "site_job": {"items", "timeout"},
    "site_reply": {"items", "failures", "broken"},
}


def read_layout(meta_bytes: bytes | memoryview, meta_crc: int, data_len: int, expected: Expected | None) -> Layout:
    if zlib.crc32(meta_bytes) != meta_crc:
        raise SerializationError("corrupted message: the metadata checksum does not match")
    meta = load_json(meta_bytes, "message metadata")
    check(isinstance(meta, dict), "not a mapping")
    check(set(meta) == {"round", "client_id", "body", "fields", "tensors"}, f"unexpected keys {sorted(meta)}")
    check(_is_int(meta["round"], 0), "round is not a non-negative integer")
    check(_is_int(meta["client_id"], -1), "client_id is not an integer >= -1")
    body = meta["body"]
    check(isinstance(body, str) and body in GROUPS, f"unknown body {body!r}")
    fields = meta["fields"]
    check(isinstance(fields, dict) and set(fields) == _FIELDS[body], f"{body} fields are not {sorted(_FIELDS[body])}")
    entries = meta["tensors"]
    check(isinstance(entries, list), "tensors is not a list")
    tensors, seen, end = [], set(), 0
    for i, e in enumerate(entries):
        check(isinstance(e, list) and len(e) == 6, f"tensor entry {i} is not [group, name, dtype, shape, offset, nbytes]")
        group, name, dtype_name, shape, offset, nbytes = e
        check(isinstance(group, str) and group in GROUPS[body], f"tensor {i}: group {group!r} is not one of {list(GROUPS[body])}")
        check(isinstance(name, str), f"tensor {i}: name is not a string")
        check((group, name) not in seen, f"tensor {name!r} appears twice in {group}")
        seen.add((group, name))
        check(isinstance(dtype_name, str) and dtype_name in DTYPES, f"tensor {name!r}: unknown dtype {dtype_name!r}")
        check(_shape_ok(shape), f"tensor {name!r}: bad shape {shape!r}")
        dtype = DTYPES[dtype_name]
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        check(
            _is_int(nbytes) and nbytes == size,
            f"tensor {name!r}: {nbytes!r} bytes, but shape {shape} of {dtype_name} needs {size}",
        )
        check(_is_int(offset) and offset == align(end), f"tensor {name!r}: offset {offset!r} is not {align(end)}")
        end = offset + nbytes
        tensors.append(_Tensor(group, name, dtype, tuple(shape), offset, nbytes))
    if end != data_len:
        raise SerializationError(f"malformed message: tensors end at byte {end} of a {data_len}-byte data section")
    layout = Layout(
        meta["round"], meta["client_id"], body, fields, tensors, align(HEADER.size + len(meta_bytes)), data_len
    )
    _check_fields(layout)
    if expected is not None:
        _check_expected(layout, expected)
    return layout


def _check_fields(layout: Layout) -> None:
    f = layout.fields
    if layout.body in BATCHES:
        _check_batch(layout)
        return
    if layout.body == "control":
        for key in ("plugin", "step"):
            check(isinstance(f[key], str) and _NAME.fullmatch(f[key]) is not None, f"control {key} {f[key]!r} is not a name")
        return
    if layout.body == "instruction":
        check(isinstance(f["task"], str) and f["task"] in {t.value for t in TaskKind}, f"unknown task {f['task']!r}")
        w = f["work"]
        check(isinstance(w, dict) and set(w) == {"client_id", "batch_size", "epochs", "local_steps"}, "bad work")
        check(_is_int(w["client_id"], 0) and _is_int(w["batch_size"], 1) and _is_int(w["epochs"], 0), "bad work")
        check(w["local_steps"] is None or _is_int(w["local_steps"], 0), "bad work.local_steps")
        check(isinstance(f["config"], dict), "config is not a mapping")
        _names(f["applied"], "applied")
    else:
        check(_is_int(f["num_examples"], 0), "num_examples is not a non-negative integer")
        _scalars(f["metrics"], "metrics")
        check(_is_int(f["client_id"], -1), "client_id is not an integer")
    if layout.body == "update":
        check(isinstance(f["kind"], str) and f["kind"] in {k.value for k in UpdateKind}, f"unknown update kind {f['kind']!r}")
        _names(f["applied"], "applied")
        check(_is_int(f["local_steps"], 0), "local_steps is not a non-negative integer")
        check(isinstance(f["compute_time"], (int, float)) and not isinstance(f["compute_time"], bool), "bad compute_time")
        check(_is_int(f["clients"], 1), "clients is not a positive integer")
        members = f["members"]
        check(
            isinstance(members, list) and all(_is_int(m, 0) for m in members) and len(members) in (0, f["clients"]),
            "members is not a list of one client id per client of the update (or empty)",
        )


def _items(layout: Layout) -> list[tuple[Layout, dict[str, dict[str, int]]]]:
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
        inner = Layout(item["round"], item["client_id"], item["body"], item["fields"], tensors, 0, 0)
        out.append((inner, item["tensors"]))
    return out


def _check_batch(layout: Layout) -> None:
    f = layout.fields
    pool = layout.tensors
    check([t.name for t in pool] == [str(i) for i in range(len(pool))], "pool tensors are not named 0..n-1 in order")
    items = f["items"]
    check(isinstance(items, list), "items is not a list")
    used: set[int] = set()
    ids: set[int] = set()
    for n, item in enumerate(items):
        check(
            isinstance(item, dict) and set(item) == {"round", "client_id", "body", "fields", "tensors"},
            f"item {n} is not a mapping of round, client_id, body, fields, tensors",
        )
        check(_is_int(item["round"]) and item["round"] == layout.round, f"item {n} is for round {item['round']!r}, the batch for {layout.round}")
        cid, kind = item["client_id"], item["body"]
        check(_is_int(cid, 0) and cid not in ids, f"item {n}: client_id {cid!r} is not a new non-negative integer")
        ids.add(cid)
        check(isinstance(kind, str) and kind in BATCHES[layout.body], f"item {n}: a {layout.body} cannot hold a message of kind {kind!r}")
        fields, refs = item["fields"], item["tensors"]
        check(isinstance(fields, dict) and set(fields) == _FIELDS[kind], f"item {n}: {kind} fields are not {sorted(_FIELDS[kind])}")
        check(isinstance(refs, dict) and set(refs) <= set(GROUPS[kind]), f"item {n}: tensor groups are not of {GROUPS[kind]}")
        for group, named in refs.items():
            check(isinstance(named, dict), f"item {n}: {group} is not a mapping of names to pool indices")
            for name, i in named.items():
                check(_is_int(i, 0) and i < len(pool), f"item {n}: {group} {name!r} names no pool tensor ({i!r})")
                used.add(i)
    check(used == set(range(len(pool))), "a pool tensor is used by no item")
    layout.items = _items(layout)
    for inner, _ in layout.items:
        _check_fields(inner)
    if layout.body == "site_job":
        t = f["timeout"]
        check(t is None or (isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0), "timeout is not positive")
    else:
        failures = f["failures"]
        check(isinstance(failures, dict), "failures is not a mapping")
        for c, why in failures.items():
            cid = ascii_id(c)
            check(cid is not None and cid not in ids and isinstance(why, str), f"failure {c!r} is not a reason of another client")
            ids.add(cast(int, cid))  # check() raised if it were None
        broken = f["broken"]
        check(
            broken is None or (isinstance(broken, str) and broken != "" and not items),
            "broken is neither null nor the reason (a non-empty string) of a site that answers for no member",
        )


def _check_expected(layout: Layout, expected: Expected) -> None:
    """The primary tensors (params / update tensors) must be known names of the expected shapes.

    Only checked when no plugin was applied: an encoded payload (compressed, masked)
    legitimately carries other names and shapes, which its plugin's decode checks.
    """
    if layout.body in BATCHES:
        for inner, _ in layout.items:
            _check_expected(inner, expected)
        return
    groups = GROUPS[layout.body]
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


def build_message(layout: Layout, values: dict[tuple[str, str], torch.Tensor]) -> Message:
    f = layout.fields
    if layout.body in BATCHES:
        messages = [
            build_message(inner, {(g, name): values[("pool", str(i))] for g, named in refs.items() for name, i in named.items()})
            for inner, refs in layout.items
        ]
        if layout.body == "site_job":
            return Message(layout.round, layout.client_id, SiteJob(messages, f["timeout"]))
        failures = {int(c): why for c, why in f["failures"].items()}
        return Message(layout.round, layout.client_id, SiteReply(messages, failures, f["broken"]))
    groups: dict[str, dict[str, torch.Tensor]] = {g: {} for g in GROUPS[layout.body]}
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


def empty_tensor(t: _Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype)


def receive_region(nbytes: int) -> mmap.mmap | None:
    """Fresh memory for a large message's tensor data (see :data:`HUGE_PAGE_BYTES`), else None."""
    if nbytes < HUGE_PAGE_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    return region


def region_view(region: mmap.mmap, t: _Tensor) -> torch.Tensor:
    """Tensor ``t`` as a view of its bytes in ``region`` (the tensor keeps the region alive)."""
    return torch.frombuffer(region, dtype=torch.uint8, count=t.nbytes, offset=t.offset).view(t.dtype).view(t.shape)


def bytes_of(tensor: torch.Tensor) -> memoryview:
    """A writable uint8 view of a fresh contiguous tensor's memory."""
    return tensor.reshape(-1).view(torch.uint8).numpy().data


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
    meta_len, meta_crc, data_len = read_header(mv, max_bytes)
    if len(mv) < HEADER.size + meta_len:
        raise SerializationError(f"truncated message: {len(mv)} bytes, the metadata alone needs {HEADER.size + meta_len}")
    layout = read_layout(mv[HEADER.size : HEADER.size + meta_len], meta_crc, data_len, expected)
    if len(mv) != layout.total:
        what = "truncated" if len(mv) < layout.total else "malformed"
        raise SerializationError(f"{what} message: {len(mv)} bytes, the header declares {layout.total}")
    values = {}
    for t in layout.tensors:
        start = layout.data_start + t.offset
        region = mv[start : start + t.nbytes]
        if t.nbytes == 0:
            value = empty_tensor(t)
        elif zero_copy:
            raw = torch.frombuffer(region, dtype=torch.uint8)
            itemsize = torch.empty((), dtype=t.dtype).element_size()
            if raw.data_ptr() % itemsize:  # unaligned for this dtype: copy rather than view
                raw = raw.clone()
            value = raw.view(t.dtype).view(t.shape)
        else:
            value = empty_tensor(t)
            bytes_of(value)[:] = region
        values[(t.group, t.name)] = value
    return build_message(layout, values)
