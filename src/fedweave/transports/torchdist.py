"""The torch.distributed transport: a site leader exchanging with its members over gloo or NCCL.

One process group per site: the leader (the group's first rank) and its members (the
other ranks, each serving one or more client ids with a :class:`~fedweave.client.ClientRuntime`).
Every collective moves one flat buffer (a *bucket* of at most ``torchdist.bucket_mb``),
never one tensor at a time:

1. **broadcast** of the round's instructions: each distinct instruction body (in FedAvg,
   the one global model all members receive) is encoded once (:mod:`fedweave.transports.serialization`)
   and the bytes are broadcast in buckets; a small JSON header says which member serves
   which client with which work. A :class:`~fedweave.types.Control` (a step of a plugin's
   own protocol, such as secure aggregation's key set-up) is meant for one client alone:
   the round's controls are encoded each on its own and **scattered**, every member
   receiving only those of the clients it serves.
2. **gather** of the reply headers (client, size, kind, examples, metrics).
3. Then either **gather** of the encoded replies in buckets (*relay*: every update reaches
   the leader whole — SCAFFOLD's control variates, FedDyn, robust rules, encoded updates,
   evaluations), or, when the leader pre-aggregates and every update is a plain same-kind
   update without extras, a **reduce** (SUM) of ``n_k · x_k`` per floating dtype bucket
   and a reduce (MAX) of integer counters: the leader receives Σ n_k x_k and Σ n_k, the
   exact weighted mean, at the cost of one model per link instead of one per member.
   Control answers, like anything but a plain update, are always gathered, never reduced.

Rendezvous comes from config (``torchdist.address`` / ``port``) or from the environment
torchrun and Slurm set (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``; ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``,
``SLURM_LAUNCH_NODE_IPADDR``). ``backend: auto`` picks NCCL when CUDA is available, else gloo.
A failed or timed-out collective breaks the site's group: the exchange reports every
member of the site as failed (the round goes on with the other sites) and later
exchanges fail at once.

An exchange's ``timeout`` travels with the round: each member runs its jobs in a thread
of their own and answers when they are done or the timeout has passed, whichever comes
first, so a job past the deadline is a failure of that client alone (its late result is
dropped; the member's next jobs wait for it at most their own deadline). Until the members
have answered, the leader's collectives end by ``timeout`` + :data:`ANSWER_GRACE` seconds: a
member that cannot take part at all (a stopped process) breaks the site then, not after
``torchdist.timeout``. The leader never waits on the members' idle group longer than
``torchdist.timeout`` (members wait there up to ``idle_timeout`` for the next round).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from fedweave.errors import ConfigError, TransportError
from fedweave.transports import serialization
from fedweave.transports.base import Exchange
from fedweave.types import Control, Instruction, Message, Update, UpdateKind, Work

log = logging.getLogger(__name__)

Handler = Callable[[Message], Message]

ANSWER_GRACE = 5.0
"""Seconds past an exchange's timeout the leader waits for the members' answers."""


@dataclass
class Rendezvous:
    """Where and as whom a process joins the torch.distributed world."""

    address: str
    port: int
    rank: int
    world_size: int
    local_rank: int = 0


def _env_int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            try:
                return int(value)  # type: ignore[arg-type]
            except ValueError:
                raise ConfigError(
                    f"environment variable {name}={value!r} is not an integer"
                ) from None
    return None


def rendezvous(
    cfg: Any,
    env: Mapping[str, str] | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
) -> Rendezvous:
    """The rendezvous from ``cfg`` (``TorchDistConfig``), then arguments, then torchrun / Slurm variables."""
    env = os.environ if env is None else env
    rank = rank if rank is not None else _env_int(env, "RANK", "SLURM_PROCID")
    world_size = (
        world_size
        if world_size is not None
        else _env_int(env, "WORLD_SIZE", "SLURM_NTASKS")
    )
    if rank is None or world_size is None:
        raise ConfigError(
            "torchdist rendezvous: rank and world size are unknown; start the process with torchrun "
            "(RANK, WORLD_SIZE) or srun (SLURM_PROCID, SLURM_NTASKS), or pass them explicitly"
        )
    if not 0 <= rank < world_size:
        raise ConfigError(
            f"torchdist rendezvous: rank {rank} is outside 0..{world_size - 1}"
        )
    address = (
        cfg.address
        or env.get("MASTER_ADDR")
        or env.get("SLURM_LAUNCH_NODE_IPADDR")
        or "127.0.0.1"
    )
    port = cfg.port if cfg.port is not None else _env_int(env, "MASTER_PORT")
    local_rank = _env_int(env, "LOCAL_RANK", "SLURM_LOCALID") or 0
    return Rendezvous(
        address, 29500 if port is None else port, rank, world_size, local_rank
    )


def choose_backend(requested: str, cuda: bool | None = None) -> str:
    """``auto``: NCCL when CUDA (and NCCL) are available, else gloo; ``nccl`` without CUDA is refused."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    nccl = cuda and dist.is_nccl_available()
    if requested == "auto":
        return "nccl" if nccl else "gloo"
    if requested == "nccl" and not nccl:
        raise ConfigError(
            "config key 'torchdist.backend': nccl needs CUDA devices and a torch built with NCCL; use gloo"
        )
    return requested


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


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class World:
    """This process's membership of the torch.distributed world, and the site groups in it."""

    def __init__(self, cfg: Any, rdv: Rendezvous, backend: str | None = None):
        self.cfg = cfg
        self.rdv = rdv
        self.backend = choose_backend(backend or cfg.backend)
        self.device = (
            torch.device("cuda", rdv.local_rank)
            if self.backend == "nccl"
            else torch.device("cpu")
        )
        self.bucket_bytes = max(1, int(cfg.bucket_mb * (1 << 20)))
        dist.init_process_group(
            self.backend,
            init_method=f"tcp://{rdv.address}:{rdv.port}",
            rank=rdv.rank,
            world_size=rdv.world_size,
            timeout=timedelta(seconds=cfg.timeout),
        )
        log.info(
            "torchdist: rank %d of %d joined (%s)",
            rdv.rank,
            rdv.world_size,
            self.backend,
        )

    def site_groups(self, sites: Sequence[Sequence[int]]) -> list[tuple[Any, Any]]:
        """Per site (lists of global ranks, leader first): its process group for data, whose
        collectives are bounded by ``torchdist.timeout``, and a control group bounded by
        ``torchdist.idle_timeout`` on which members wait for the next round. Every rank must call this."""
        idle = timedelta(seconds=self.cfg.idle_timeout)
        return [
            (
                dist.new_group(list(ranks), backend=self.backend),
                dist.new_group(list(ranks), backend=self.backend, timeout=idle),
            )
            for ranks in sites
        ]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class _Site:
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


def _layout(update: Update) -> list[list[Any]]:
    return [
        [k, str(v.dtype).removeprefix("torch."), list(v.shape)]
        for k, v in sorted(update.tensors.items())
    ]


def _reduce_update(
    site: _Site, layout: list[list[Any]], updates: Sequence[Update], bucket: int
) -> dict[str, torch.Tensor]:
    """Σ n_k x_k (floats) and max x_k (integers) over the site's ``updates``, on the leader."""
    floats: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    ints: list[tuple[str, torch.Tensor]] = []
    for name, dtype_name, shape in layout:
        dtype = getattr(torch, dtype_name)
        if dtype.is_floating_point:
            acc = _accumulator(dtype)
            value = torch.zeros(shape, dtype=acc)
            for u in updates:
                value.add_(u.tensors[name].to(acc), alpha=u.num_examples)
            floats.setdefault(acc, []).append((name, value))
        else:
            low = torch.iinfo(torch.int64).min if dtype != torch.bool else 0
            value = torch.full(shape, low, dtype=torch.int64)
            for u in updates:
                value = torch.maximum(value, u.tensors[name].to(torch.int64))
            ints.append((name, value))
    out: dict[str, torch.Tensor] = {}
    for acc in sorted(floats, key=str):
        names = [n for n, _ in floats[acc]]
        out.update(
            zip(
                names,
                site.reduce_flat(
                    [t for _, t in floats[acc]], dist.ReduceOp.SUM, bucket
                ),
            )
        )
    out.update(
        zip(
            [n for n, _ in ints],
            site.reduce_flat([t for _, t in ints], dist.ReduceOp.MAX, bucket),
        )
    )
    return out


class TorchDistLeader(_Site):
    """The :class:`~fedweave.transports.base.Transport` of a site leader over its group.

    ``pre_aggregate``: answer one update, the weighted mean computed by a reduce, when the
    members' updates allow it exactly (see the module doc); else relay every reply.
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
            sums = _reduce_update(self, replies[0]["layout"], [], bucket)
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


class TorchDistMember(_Site):
    """A member of a site: serves the clients the leader assigns it with ``handler`` until told to stop."""

    def __init__(
        self,
        world: World,
        group: tuple[Any, Any],
        ranks: Sequence[int],
        handler: Handler,
    ):
        super().__init__(world, group, ranks)
        self.handler = handler
        self._late: threading.Thread | None = None  # jobs of an earlier round still running

    def serve(self) -> int:
        """Answer rounds until the leader stops the site; return the jobs answered."""
        done = 0
        while True:
            header = json.loads(self.broadcast_bytes(None, idle=True))
            if header["op"] == "stop":
                return done
            timeout = header.get("timeout")
            deadline = None if timeout is None else time.monotonic() + timeout
            blob = self.broadcast_bytes(None)
            own = self.scatter_bytes(None) if header["controls"] else bytearray()
            offsets = [0]
            for size in header["sizes"]:
                offsets.append(offsets[-1] + size)
            mine: list[tuple[int, Message]] = []
            failures: dict[int, str] = {}
            for rank, index, cid, work in header["jobs"]:
                if rank != self.world.rdv.rank:
                    continue
                try:
                    template = serialization.decode(
                        blob[offsets[index] : offsets[index + 1]], copy=True
                    )
                    if not isinstance(template.body, Instruction):
                        raise serialization.SerializationError(
                            f"a shared template holds a {type(template.body).__name__}, not an instruction"
                        )
                    body = dataclasses.replace(template.body, work=Work(**work))
                    mine.append((cid, Message(template.round, cid, body)))
                except Exception as exc:  # one client's failure must not stop the site
                    log.warning("client %d: instruction refused: %s", cid, exc)
                    failures[cid] = f"{type(exc).__name__}: {exc}"
            offset = 0
            for rank, cid, size in header["controls"]:
                if rank != self.world.rdv.rank:
                    continue
                data, offset = own[offset : offset + size], offset + size
                try:
                    msg = serialization.decode(data)
                    if not isinstance(msg.body, Control) or msg.client_id != cid:
                        raise serialization.SerializationError(
                            f"a control step for client {cid} holds a {type(msg.body).__name__} for client {msg.client_id}"
                        )
                    mine.append((cid, msg))
                except Exception as exc:  # one client's failure must not stop the site
                    log.warning("client %d: control step refused: %s", cid, exc)
                    failures[cid] = f"{type(exc).__name__}: {exc}"
            answers = self._run(mine, deadline, timeout)
            replies: list[tuple[dict[str, Any], bytes, Message]] = []
            for cid, _ in mine:
                reply = answers[cid]
                if isinstance(reply, str):
                    failures[cid] = reply
                    continue
                data = bytes(serialization.encode(reply))
                replies.append((self._describe(reply, len(data)), data, reply))
                done += 1
            self.gather_bytes(
                json.dumps(
                    {"replies": [r[0] for r in replies], "failures": failures}
                ).encode()
            )
            mode = json.loads(self.broadcast_bytes(None))
            if (
                mode["mode"] == "reduce"
            ):  # this member's updates form one contribution to the sum
                _reduce_update(
                    self, mode["layout"], [r[2].body for r in replies], mode["bucket"]
                )  # type: ignore[misc]
            else:
                self.gather_bytes(b"".join(r[1] for r in replies))

    def _run(
        self, jobs: list[tuple[int, Message]], deadline: float | None, timeout: float | None
    ) -> dict[int, Message | str]:
        """Each job's reply, or why it failed: the jobs run in order in a thread of their own, and
        those not done by ``deadline`` fail (the thread finishes its current job, then stops)."""
        answers: dict[int, Message | str] = {}
        stop = threading.Event()

        def work() -> None:
            for cid, msg in jobs:
                if stop.is_set():
                    return
                try:
                    answers[cid] = self.handler(msg)
                except Exception as exc:  # one client's failure must not stop the site
                    log.warning("client %d failed: %s", cid, exc, exc_info=True)
                    answers[cid] = f"{type(exc).__name__}: {exc}"

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        if self._late is not None:
            self._late.join(left())
            if self._late.is_alive():
                why = "still training a job of an earlier round that missed its deadline"
                return {cid: why for cid, _ in jobs}
            self._late = None
        thread = threading.Thread(target=work, name="fedweave-member-jobs", daemon=True)
        thread.start()
        thread.join(left())
        if thread.is_alive():
            stop.set()
            self._late = thread
        done = dict(answers)  # a job that ends from now on is late: dropped
        missed = f"missed the round deadline ({timeout:.3g} s)" if timeout is not None else "no answer"
        for cid, _ in jobs:
            if cid not in done:
                log.warning("client %d: %s", cid, missed)
        return {cid: done.get(cid, missed) for cid, _ in jobs}

    @staticmethod
    def _describe(reply: Message, size: int) -> dict[str, Any]:
        body = reply.body
        desc: dict[str, Any] = {
            "client_id": reply.client_id,
            "size": size,
            "combinable": False,
        }
        if isinstance(body, Update):
            desc.update(
                combinable=not body.applied and not body.extras,
                kind=body.kind.value,
                layout=_layout(body),
                num_examples=body.num_examples,
                metrics=body.metrics,
                local_steps=body.local_steps,
                compute_time=body.compute_time,
            )
        return desc
