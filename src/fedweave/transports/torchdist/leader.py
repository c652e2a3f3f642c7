"""The site leader's side: the :class:`~fedweave.transports.base.Transport` that sends a round to
the site's members and collects their replies, relayed or pre-aggregated by reduce."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fedweave.errors import TransportError
from fedweave.transports import serialization
from fedweave.transports.base import Exchange
from fedweave.transports.torchdist.group import SiteGroup
from fedweave.transports.torchdist.reduce import reduce_update
from fedweave.transports.torchdist.world import World
from fedweave.types import Control, Instruction, Message, Update, UpdateKind

log = logging.getLogger(__name__)

ANSWER_GRACE = 5.0
"""Seconds past an exchange's timeout the leader waits for the members' answers."""


class TorchDistLeader(SiteGroup):
    """The :class:`~fedweave.transports.base.Transport` of a site leader over its group.

    ``pre_aggregate``: answer one update, the weighted mean computed by a reduce, when the
    members' updates allow it exactly (see the module doc); else relay every reply.
    ``broken``: why the group broke (a collective failed), after which every exchange fails at once
    (:class:`~fedweave.transports.base.BreaksWhole`).
    """

    def __init__(
        self,
        world: World,
        group: tuple[Any, Any],
        ranks: Sequence[int],
        members: Mapping[int, int],
        pre_aggregate: bool = False,
    ):
        super().__init__(world, group, ranks)
        self.members = dict(members)  # client id -> global rank
        self.pre_aggregate = pre_aggregate
        self.broken: str | None = None

    def exchange(self, messages: list[Message], timeout: float | None) -> Exchange:
        result = Exchange()
        unknown = [m.client_id for m in messages if m.client_id not in self.members]
        if unknown:
            raise TransportError(f"clients {unknown} are not members of this site")
        other = sorted({type(m.body).__name__ for m in messages if not isinstance(m.body, (Instruction, Control))})
        if other:
            raise TransportError(f"a site leader sends its members instructions and control steps, not {', '.join(other)}")
        if self.broken:
            result.failures = {
                m.client_id: f"site group broken: {self.broken}" for m in messages
            }
            return result
        try:
            return self._exchange(messages, timeout)
        except (
            RuntimeError,
            ValueError,
            serialization.SerializationError,
        ) as exc:  # a collective failed or timed out
            self.broken = f"{type(exc).__name__}: {exc}"
            log.error("torchdist site of ranks %s failed: %s", self.ranks, self.broken)
            result.failures = {
                m.client_id: f"site group broken: {self.broken}" for m in messages
            }
            return result

    def _exchange(self, messages: list[Message], timeout: float | None) -> Exchange:
        deadline = None if timeout is None else time.monotonic() + timeout
        templates: list[bytes] = []
        keys: dict[tuple[Any, ...], int] = {}
        jobs = []
        own: list[list[bytearray]] = [[] for _ in self.ranks]  # per rank: its clients' control steps
        controls = []
        for m in messages:
            body = m.body
            if isinstance(body, Control):
                rank = self.members[m.client_id]
                data = serialization.encode(m)
                own[self.ranks.index(rank)].append(data)
                controls.append([rank, m.client_id, len(data)])
                continue
            assert isinstance(body, Instruction)  # exchange() refused any other body
            key = (
                m.round,
                body.task,
                json.dumps(body.config, sort_keys=True),
                tuple(body.applied),
                tuple((k, id(v)) for k, v in body.params.items()),
                tuple((k, id(v)) for k, v in body.extras.items()),
            )
            if key not in keys:
                keys[key] = len(templates)
                templates.append(bytes(serialization.encode(m)))
            jobs.append(
                [
                    self.members[m.client_id],
                    keys[key],
                    m.client_id,
                    dataclasses.asdict(body.work),
                ]
            )
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        header = {
            "op": "round", "sizes": [len(t) for t in templates], "jobs": jobs, "controls": controls, "timeout": remaining
        }
        # until the members have answered, every collective ends by the deadline + grace
        self.until = None if deadline is None else deadline + ANSWER_GRACE
        try:
            self.broadcast_bytes(json.dumps(header).encode(), idle=True)
            self.broadcast_bytes(b"".join(templates))
            if controls:
                self.scatter_bytes(own)
            gathered = self.gather_bytes(b"")
        finally:
            self.until = None
        assert gathered is not None
        heads = [
            json.loads(g) if g else {"replies": [], "failures": {}} for g in gathered
        ]
        result = Exchange(bytes_sent=sum(len(t) for t in templates) + sum(size for _, _, size in controls))
        for h in heads:
            result.failures.update({int(c): why for c, why in h["failures"].items()})
        replies = [r for h in heads for r in h["replies"]]
        reduce = (
            self.pre_aggregate
            and len(replies) > 1
            and all(
                r["combinable"]
                and r["kind"] == replies[0]["kind"]
                and r["layout"] == replies[0]["layout"]
                for r in replies
            )
        )
        bucket = self.world.bucket_bytes
        mode = (
            {"mode": "reduce", "layout": replies[0]["layout"], "bucket": bucket}
            if reduce
            else {"mode": "gather"}
        )
        self.broadcast_bytes(json.dumps(mode).encode())
        order = {m.client_id: i for i, m in enumerate(messages)}
        if reduce:
            sums = reduce_update(self, replies[0]["layout"], [], bucket)
            total = sum(r["num_examples"] for r in replies)
            tensors = {}
            for name, dtype_name, _ in replies[0]["layout"]:
                dtype = getattr(torch, dtype_name)
                tensors[name] = (
                    (sums[name] / total).to(dtype)
                    if dtype.is_floating_point
                    else sums[name].to(dtype)
                )
            first = min(replies, key=lambda r: order[r["client_id"]])
            names = set.intersection(*(set(r["metrics"]) for r in replies))
            update = Update(
                kind=UpdateKind(first["kind"]),
                tensors=tensors,
                num_examples=total,
                metrics={
                    k: sum(r["metrics"][k] * r["num_examples"] for r in replies) / total
                    for k in sorted(names)
                },
                client_id=first["client_id"],
                local_steps=max(r["local_steps"] for r in replies),
                compute_time=max(r["compute_time"] for r in replies),
                clients=len(replies),
                members=sorted((r["client_id"] for r in replies), key=order.__getitem__),
            )
            result.replies = [Message(messages[0].round, first["client_id"], update)]
            result.bytes_received = sum(
                t.numel() * t.element_size() for t in tensors.values()
            )
            return result
        payloads = self.gather_bytes(b"")
        assert payloads is not None
        for h, payload in zip(heads, payloads):
            offset = 0
            for r in h["replies"]:
                data = payload[offset : offset + r["size"]]
                offset += r["size"]
                result.bytes_received += len(data)
                result.replies.append(serialization.decode(data))
        result.replies.sort(key=lambda r: order.get(r.client_id, len(order)))
        return result

    def close(self) -> None:
        """Tell the members the run is over (they leave their serve loop)."""
        if self.broken is None:
            try:
                self.broadcast_bytes(json.dumps({"op": "stop"}).encode(), idle=True)
            except RuntimeError as exc:
                log.warning(
                    "torchdist: could not stop the site of ranks %s: %s",
                    self.ranks,
                    exc,
                )
            self.broken = "closed"
