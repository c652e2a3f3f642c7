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


@dataclasses.dataclass
class RoundPlan:
    """What a round sends: each distinct job once (``templates``), who runs which (``jobs``), and
    each rank's control steps (``own``, described by ``controls``)."""

    templates: list[bytes]
    jobs: list[list[Any]]
    own: list[list[bytearray]]
    controls: list[list[int]]

    @property
    def bytes_sent(self) -> int:
        return sum(len(t) for t in self.templates) + sum(size for _, _, size in self.controls)


def round_plan(messages: list[Message], members: Mapping[int, int], ranks: Sequence[int]) -> RoundPlan:
    """Encode a round's messages: instructions that share their content (round, task, config, plugins
    applied and the very tensors) are one template; a control step goes to its member's rank alone."""
    plan = RoundPlan([], [], [[] for _ in ranks], [])
    keys: dict[tuple[Any, ...], int] = {}
    for m in messages:
        body = m.body
        if isinstance(body, Control):
            rank = members[m.client_id]
            data = serialization.encode(m)
            plan.own[ranks.index(rank)].append(data)
            plan.controls.append([rank, m.client_id, len(data)])
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
            keys[key] = len(plan.templates)
            plan.templates.append(bytes(serialization.encode(m)))
        plan.jobs.append([members[m.client_id], keys[key], m.client_id, dataclasses.asdict(body.work)])
    return plan


def mean_tensors(sums: Mapping[str, torch.Tensor], layout: list[Any], total: int) -> dict[str, torch.Tensor]:
    """The reduced sums over ``total`` examples in each tensor's dtype (floating ones divided, counters kept)."""
    tensors = {}
    for name, dtype_name, _ in layout:
        dtype = getattr(torch, dtype_name)
        tensors[name] = (sums[name] / total).to(dtype) if dtype.is_floating_point else sums[name].to(dtype)
    return tensors


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
        """One round over the group: send each distinct job once and each control step to its
        member's rank, gather the answers' heads, then either reduce them into one update or
        gather every reply."""
        deadline = None if timeout is None else time.monotonic() + timeout
        plan = round_plan(messages, self.members, self.ranks)
        heads = self._send_round(plan, deadline)
        result = Exchange(bytes_sent=plan.bytes_sent)
        for h in heads:
            result.failures.update({int(c): why for c, why in h["failures"].items()})
        replies = [r for h in heads for r in h["replies"]]
        order = {m.client_id: i for i, m in enumerate(messages)}
        if self._announce_mode(replies):
            return self._reduced(result, replies, order, messages[0].round)
        return self._gathered(result, heads, order)

    def _send_round(self, plan: RoundPlan, deadline: float | None) -> list[dict[str, Any]]:
        """Broadcast the round's header and jobs, scatter the control steps, gather each rank's head."""
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        header = {
            "op": "round", "sizes": [len(t) for t in plan.templates], "jobs": plan.jobs, "controls": plan.controls,
            "timeout": remaining,
        }
        # until the members have answered, every collective ends by the deadline + grace
        self.until = None if deadline is None else deadline + ANSWER_GRACE
        try:
            self.broadcast_bytes(json.dumps(header).encode(), idle=True)
            self.broadcast_bytes(b"".join(plan.templates))
            if plan.controls:
                self.scatter_bytes(plan.own)
            gathered = self.gather_bytes(b"")
        finally:
            self.until = None
        assert gathered is not None
        return [json.loads(g) if g else {"replies": [], "failures": {}} for g in gathered]

    def _announce_mode(self, replies: list[dict[str, Any]]) -> bool:
        """Tell the members whether the replies are reduced (pre-aggregation, when every reply is
        combinable with the same kind and layout) or gathered; True for a reduce."""
        reduce = (
            self.pre_aggregate
            and len(replies) > 1
            and all(
                r["combinable"] and r["kind"] == replies[0]["kind"] and r["layout"] == replies[0]["layout"]
                for r in replies
            )
        )
        bucket = self.world.bucket_bytes
        mode = {"mode": "reduce", "layout": replies[0]["layout"], "bucket": bucket} if reduce else {"mode": "gather"}
        self.broadcast_bytes(json.dumps(mode).encode())
        return reduce

    def _reduced(
        self, result: Exchange, replies: list[dict[str, Any]], order: dict[int, int], rnd: int
    ) -> Exchange:
        """The members' updates summed by a reduce: one update, their weighted mean."""
        layout = replies[0]["layout"]
        sums = reduce_update(self, layout, [], self.world.bucket_bytes)
        total = sum(r["num_examples"] for r in replies)
        tensors = mean_tensors(sums, layout, total)
        first = min(replies, key=lambda r: order[r["client_id"]])
        names = set.intersection(*(set(r["metrics"]) for r in replies))
        update = Update(
            kind=UpdateKind(first["kind"]),
            tensors=tensors,
            num_examples=total,
            metrics={k: sum(r["metrics"][k] * r["num_examples"] for r in replies) / total for k in sorted(names)},
            client_id=first["client_id"],
            local_steps=max(r["local_steps"] for r in replies),
            compute_time=max(r["compute_time"] for r in replies),
            clients=len(replies),
            members=sorted((r["client_id"] for r in replies), key=order.__getitem__),
        )
        result.replies = [Message(rnd, first["client_id"], update)]
        result.bytes_received = sum(t.numel() * t.element_size() for t in tensors.values())
        return result

    def _gathered(self, result: Exchange, heads: list[dict[str, Any]], order: dict[int, int]) -> Exchange:
        """Every member's replies, gathered and decoded, in the order of the messages."""
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
