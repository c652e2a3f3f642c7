"""Encoding: a message laid out (header, metadata, aligned tensors), whole or as chunks."""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fedweave.errors import SerializationError
from fedweave.transports.serialization.format import (
    BATCHES,
    CHUNK_BYTES,
    DTYPES,
    HEADER,
    MAGIC,
    VERSION,
    align,
)
from fedweave.types import Control, Evaluation, Instruction, Message, SiteJob, SiteReply, Update

_NAMES = {dtype: name for name, dtype in DTYPES.items()}


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
    return t.reshape(-1).view(torch.uint8).numpy().data


def _body_fields(body: Any) -> tuple[str, dict[str, Any], dict[str, Mapping[str, torch.Tensor]]]:
    if isinstance(body, Instruction):
        w = body.work
        fields: dict[str, Any] = {
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
        if inner not in BATCHES[kind]:
            raise SerializationError(f"a {kind} cannot hold a message of kind {inner!r} (only {', '.join(BATCHES[kind])})")
        refs: dict[str, dict[str, int]] = {}
        for group, named in groups.items():
            refs[group] = {}
            for name, t in named.items():
                refs[group][name] = pool.setdefault(id(t), (len(pool), t))[0]
        items.append({"round": m.round, "client_id": m.client_id, "body": inner, "fields": fields, "tensors": refs})
    extra: dict[str, Any] = (
        {"timeout": body.timeout}
        if isinstance(body, SiteJob)
        else {"failures": {str(c): str(why) for c, why in body.failures.items()}, "broken": body.broken}
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
            offset = align(offset)
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
    head += bytes(align(len(head)) - len(head))
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
