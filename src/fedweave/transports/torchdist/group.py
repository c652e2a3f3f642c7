"""One site group's collectives: each counted, bounded in time and moving one flat buffer in
buckets of at most ``torchdist.bucket_mb`` (broadcast, scatter, gather of bytes; reduce of tensors)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from fedweave.transports.torchdist.world import World


def plan_buckets(sizes: Sequence[int], bucket_bytes: int) -> list[tuple[int, int]]:
    """Consecutive ``(start, end)`` index ranges whose sizes sum to at most ``bucket_bytes``
    (an item larger than a bucket gets one of its own)."""
    out: list[tuple[int, int]] = []
    start, used = 0, 0
    for i, size in enumerate(sizes):
        if i > start and used + size > bucket_bytes:
            out.append((start, i))
            start, used = i, 0
        used += size
    if start < len(sizes):
        out.append((start, len(sizes)))
    return out


def _chunks(total: int, bucket_bytes: int) -> list[tuple[int, int]]:
    return [(o, min(total, o + bucket_bytes)) for o in range(0, total, bucket_bytes)]


class SiteGroup:
    """Collectives of one site group, each counted (``calls``) and on one flat buffer."""

    def __init__(self, world: World, group: tuple[Any, Any], ranks: Sequence[int]):
        self.world = world
        self.group, self.control = group
        self.ranks = list(ranks)
        self.leader = self.ranks[0]
        self.calls: Counter[str] = Counter()
        self.until: float | None = None  # monotonic time by which every collective must end

    @property
    def is_leader(self) -> bool:
        return self.world.rdv.rank == self.leader

    def _collective(self, kind: str, call: Any, *args: Any, idle: bool = False, **kw: Any) -> None:
        """Run collective ``call`` and wait for it: until ``self.until`` when set, else the group's
        timeout (``torchdist.timeout``; a member waiting ``idle`` for a round: ``idle_timeout``;
        the leader never waits idle)."""
        self.calls[kind] += 1
        if self.until is not None:
            limit = self.until - time.monotonic()
        elif idle and self.is_leader:
            limit = self.world.cfg.timeout
        else:
            call(*args, **kw)
            return
        work = call(*args, async_op=True, **kw)
        try:
            work.wait(timeout=timedelta(seconds=max(limit, 0.001)))
        except RuntimeError as exc:
            raise RuntimeError(
                f"not every rank of {self.ranks} took part in a {kind} within {max(limit, 0.0):.3g} s ({exc})"
            ) from None

    def _dev(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.world.device)

    def broadcast_bytes(
        self, data: bytes | bytearray | None, idle: bool = False
    ) -> bytearray:
        """The leader's bytes on every rank: a length and the leader's bucket size, then buckets.
        ``idle``: the length travels on the control group (members waiting for the next round)."""
        size = self._dev(
            torch.tensor(
                [len(data) if data is not None else 0, self.world.bucket_bytes],
                dtype=torch.int64,
            )
        )
        self._collective(
            "broadcast", dist.broadcast, size, src=self.leader,
            group=self.control if idle else self.group, idle=idle,
        )
        total, bucket = int(size[0]), int(size[1])
        buf = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if data
            else torch.empty(total, dtype=torch.uint8)
        )
        out = bytearray(total)
        for lo, hi in _chunks(total, bucket):
            piece = self._dev(
                buf[lo:hi].clone()
                if data is not None
                else torch.empty(hi - lo, dtype=torch.uint8)
            )
            self._collective("broadcast", dist.broadcast, piece, src=self.leader, group=self.group)
            out[lo:hi] = piece.cpu().numpy().tobytes()
        return out

    def scatter_bytes(self, data: Sequence[Sequence[bytearray]] | None) -> bytearray:
        """The leader's ``data[i]`` (a list of buffers, concatenated) on the site's i-th rank
        (``data`` is given on the leader only): every rank's length and the leader's bucket
        size, then padded buckets."""
        n = len(self.ranks)
        lengths = [sum(len(d) for d in mine) for mine in data] if data is not None else [0] * n
        head = self._dev(torch.tensor([*lengths, self.world.bucket_bytes], dtype=torch.int64))
        self._collective("broadcast", dist.broadcast, head, src=self.leader, group=self.group)
        lengths, bucket = [int(x) for x in head[:n]], int(head[n])
        total = max(lengths)
        padded = None
        if data is not None:
            padded = [torch.zeros(total, dtype=torch.uint8) for _ in range(n)]
            for buf, mine in zip(padded, data):
                at = 0
                for d in mine:
                    if d:
                        buf[at : at + len(d)] = torch.frombuffer(d, dtype=torch.uint8)
                    at += len(d)
        out = bytearray(total)
        for lo, hi in _chunks(total, bucket):
            piece = self._dev(torch.empty(hi - lo, dtype=torch.uint8))
            parts = [self._dev(buf[lo:hi]) for buf in padded] if padded is not None else None
            self._collective("scatter", dist.scatter, piece, parts, src=self.leader, group=self.group)
            out[lo:hi] = piece.cpu().numpy().tobytes()
        return out[: lengths[self.ranks.index(self.world.rdv.rank)]]

    def gather_bytes(self, data: bytes | bytearray) -> list[bytearray] | None:
        """Every rank's bytes on the leader (None elsewhere): lengths, then padded buckets."""
        n = len(self.ranks)
        size = self._dev(torch.tensor([len(data)], dtype=torch.int64))
        sizes_t = (
            [self._dev(torch.zeros(1, dtype=torch.int64)) for _ in range(n)]
            if self.is_leader
            else None
        )
        self._collective("gather", dist.gather, size, sizes_t, dst=self.leader, group=self.group)
        # every rank pads its buckets alike: the leader broadcasts the largest size and its bucket size
        longest = self._dev(
            torch.tensor(
                [
                    max(int(s.item()) for s in sizes_t) if sizes_t else 0,
                    self.world.bucket_bytes,
                ],
                dtype=torch.int64,
            )
        )
        self._collective("broadcast", dist.broadcast, longest, src=self.leader, group=self.group)
        total, bucket = int(longest[0]), int(longest[1])
        mine = torch.zeros(total, dtype=torch.uint8)
        if data:
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        outs = [bytearray(total) for _ in range(n)] if self.is_leader else None
        for lo, hi in _chunks(total, bucket):
            piece = self._dev(mine[lo:hi].clone())
            parts = (
                [self._dev(torch.empty(hi - lo, dtype=torch.uint8)) for _ in range(n)]
                if self.is_leader
                else None
            )
            self._collective("gather", dist.gather, piece, parts, dst=self.leader, group=self.group)
            if outs is not None and parts is not None:
                for out, part in zip(outs, parts):
                    out[lo:hi] = part.cpu().numpy().tobytes()
        if outs is None or sizes_t is None:
            return None
        return [out[: int(s.item())] for out, s in zip(outs, sizes_t)]

    def reduce_flat(
        self, tensors: list[torch.Tensor], op: Any, bucket: int
    ) -> list[torch.Tensor]:
        """Reduce same-dtype ``tensors`` onto the leader, bucket by bucket (flattened; the leader's bucket size)."""
        if not tensors:
            return []
        sizes = [t.numel() * t.element_size() for t in tensors]
        out: list[torch.Tensor] = []
        for lo, hi in plan_buckets(sizes, bucket):
            flat = self._dev(torch.cat([t.reshape(-1) for t in tensors[lo:hi]]))
            self._collective("reduce", dist.reduce, flat, dst=self.leader, op=op, group=self.group)
            flat = flat.cpu()
            offset = 0
            for t in tensors[lo:hi]:
                out.append(flat[offset : offset + t.numel()].view(t.shape))
                offset += t.numel()
        return out
