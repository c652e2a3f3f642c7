"""SecAgg's client half: its answers to the control steps and the masking of its update
(step 2). Its secrets live in the client's private state, ``ctx.state``, and never leave its
process; each is dropped as soon as the protocol no longer needs it."""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from fedweave.plugins.contracts import PluginContext
from fedweave.plugins.packing import flatten
from fedweave.plugins.secure import pedersen, shamir
from fedweave.plugins.secure.secagg.keys import (
    KEY_BYTES,
    SEALED_SHARES,
    SECRET_BYTES,
    SHARE_BYTES,
    associated_data,
    crypto,
    sender_nonce,
    open_sealed,
    public_key,
    hkdf,
    pair_info,
)
from fedweave.plugins.secure.secagg.masking import Field
from fedweave.plugins.secure.secagg.messages import (
    ADVERTISE,
    FORWARD,
    MASKED,
    MASKED_STEP,
    MASKING,
    SHARE,
    UNMASK,
    body_tensor,
    commitments,
    id_list,
    ids,
    read_commitments,
    read_shares,
    share_bytes,
    u8,
)
from fedweave.plugins.secure.secagg.neighbours import threshold_of
from fedweave.plugins.secure.secagg.params import SecAggHParams
from fedweave.plugins.secure.secagg.quantization import Quantizer
from fedweave.types import Control, Update

log = logging.getLogger(__name__)


class ClientRound:
    """One client's secrets for one round, in its private state (its own process); each is
    dropped as soon as the protocol no longer needs it."""

    def __init__(self, rnd: int):
        self.round = rnd
        self.step = ADVERTISE
        self.key: Any = crypto().PrivateKey.generate()  # k_u
        self.public = self.key.public_key().public_bytes_raw()  # K_u
        self.self_seed: bytes | None = os.urandom(SECRET_BYTES)  # b_u
        self.record_key: bytes | None = os.urandom(SECRET_BYTES)  # r_u: opens the seed record; rebuilt if it drops
        self.neighbours: tuple[int, ...] = ()
        self.threshold = 0
        self.channels: dict[int, bytes] = {}  # neighbour -> c_uv
        self.seeds: dict[int, bytes] = {}  # neighbour -> s_uv
        self.shares: dict[int, list[shamir.Share]] = {}  # owner -> this client's shares of (r_owner, b_owner)
        self.candidates: list[int] = []  # neighbours whose shares it holds, verified: it may mask with them
        self.masking: list[int] = []  # those the server says it masks with


class SecAggClient:
    """The client's steps of :class:`~fedweave.plugins.secure.secagg.SecAgg` (which sets these attributes)."""

    name: str
    hp: SecAggHParams
    field: Field
    quantize: Quantizer
    seed: int
    graph: Callable[[int, list[int]], dict[int, tuple[int, ...]]]

    def answer(self, control: Control, ctx: PluginContext) -> Control:
        """The client's side of steps 0, 1, forward and 3, with its secrets in ``ctx.state``."""
        if ctx.state is None:
            raise ValueError("secagg's client half needs the client's private state (ctx.state)")
        if control.step == ADVERTISE:
            mine = ClientRound(ctx.round)
            ctx.state[self.name] = mine
            return Control(self.name, ADVERTISE, {"key": u8([mine.public], KEY_BYTES)})
        if control.step == SHARE:
            return self._share(control, self._client_round(ctx, ADVERTISE), ctx.client_id)
        if control.step == FORWARD:
            return self._receive(control, self._client_round(ctx, SHARE), ctx.client_id)
        if control.step == UNMASK:
            mine = self._client_round(ctx, MASKED_STEP)
            del ctx.state[self.name]  # one answer per round: the server never gets both secrets of a client
            return self._reveal(control, mine, ctx.client_id)
        raise ValueError(f"secagg has no step {control.step!r}")

    def _share(self, control: Control, mine: ClientRound, u: int) -> Control:
        c = crypto()
        members = id_list(control, "cohort")
        if u not in members:
            raise ValueError(f"secagg share: client {u} is not in the cohort it was sent")
        neighbours = self.graph(mine.round, members)[u]  # the client derives its neighbourhood itself
        rows = [bytes(row) for row in body_tensor(control, "keys", torch.uint8, (len(neighbours), KEY_BYTES))]
        if len({*rows, mine.public}) != len(rows) + 1:
            raise ValueError("secagg share: the neighbours' public keys are not distinct")
        for v, row in zip(neighbours, rows):
            (pair,) = hkdf(mine.key.exchange(public_key(row)), pair_info(mine.round, u, v))
            mine.channels[v], mine.seeds[v] = pair[:SECRET_BYTES], pair[SECRET_BYTES:]
        mine.key = None  # the channel keys and seeds are all this client needs of it
        mine.neighbours = neighbours
        mine.threshold = threshold_of(self.hp.threshold, len(neighbours))
        assert mine.record_key is not None and mine.self_seed is not None
        record = c.AESGCM(mine.record_key).encrypt(
            sender_nonce(u), b"".join(mine.seeds[v] for v in neighbours), associated_data("seeds", mine.round, u, u)
        )
        points = sorted((u, *neighbours))
        secrets = [int.from_bytes(mine.record_key, "big"), int.from_bytes(mine.self_seed, "big")]
        dealt = shamir.split(secrets, mine.threshold, [h + 1 for h in points])
        index = {h: i for i, h in enumerate(points)}
        mine.shares[u] = dealt.shares[index[u]]
        sealed = [
            c.AESGCM(mine.channels[v]).encrypt(
                sender_nonce(u), share_bytes(dealt.shares[index[v]]), associated_data("share", mine.round, u, v)
            )
            for v in neighbours
        ]
        mine.record_key = None  # sealed its seeds; its own share of r_u is all it keeps
        mine.step = SHARE
        return Control(self.name, SHARE, {
            "record": u8([record], len(record)),
            "shares": u8(sealed, SEALED_SHARES),
            "commitments": commitments(dealt.commitments),
        })

    def _receive(self, control: Control, mine: ClientRound, u: int) -> Control:
        """Open and verify each neighbour's shares; answer the senders whose shares do not open (not sealed
        by them for this client) or do not match their commitments (not on the polynomial they committed
        to): the pair does not mask, and this client holds no share of theirs."""
        senders = id_list(control, "senders", mine.neighbours)
        if len(senders) + 1 < mine.threshold:
            raise ValueError(
                f"secagg forward: only {len(senders)} neighbours completed the set-up, fewer than the "
                f"threshold {mine.threshold} of this client's neighbourhood"
            )
        sealed = body_tensor(control, "shares", torch.uint8, (len(senders), SEALED_SHARES))
        # every neighbourhood of the round has the same size (neighbours.ring), so the same threshold
        committed = body_tensor(
            control, "commitments", torch.uint8, (len(senders), 2, mine.threshold, pedersen.ELEMENT_BYTES)
        )
        refused = []
        for v, row, coms in zip(senders, sealed, committed):
            try:
                aad = associated_data("share", mine.round, v, u)
                share = read_shares(open_sealed(mine.channels[v], sender_nonce(v), bytes(row), aad, f"the share from client {v}"))
                if not all(shamir.verify(u + 1, s, c) for s, c in zip(share, read_commitments(coms))):
                    raise ValueError(f"secagg: the share from client {v} does not match its commitments")
            except ValueError as exc:
                log.warning("round %d: client %d refuses client %d's shares: %s", mine.round, u, v, exc)
                refused.append(v)
                continue
            mine.shares[v] = share
        mine.candidates = [v for v in senders if v not in refused]
        mine.seeds = {v: mine.seeds[v] for v in mine.candidates}
        mine.channels = {}
        mine.step = FORWARD
        return Control(self.name, FORWARD, {"refused": ids(refused)})

    def _reveal(self, control: Control, mine: ClientRound, u: int) -> Control:
        survivors = id_list(control, "survivors", mine.masking)
        if len(survivors) + 1 < mine.threshold:
            raise ValueError(
                f"secagg unmask: only {len(survivors)} neighbours survived, fewer than the threshold "
                f"{mine.threshold} of this client's neighbourhood; no share is revealed"
            )
        gone = [w for w in mine.masking if w not in survivors]
        seed = [share_bytes([mine.shares[w][1]]) for w in sorted([u, *survivors])]
        key = [share_bytes([mine.shares[w][0]]) for w in gone]
        return Control(self.name, UNMASK, {"seed": u8(seed, SHARE_BYTES), "key": u8(key, SHARE_BYTES)})

    def _masking(self, mine: ClientRound, config: Any, u: int) -> list[int]:
        """Whom the server says this client masks with: a sorted list of distinct candidates, enough for
        the threshold."""
        masking = config.get(MASKING)
        if not (isinstance(masking, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in masking)):
            raise ValueError(f"client {u}: instruction config {MASKING!r} is not a list of client ids")
        if masking != sorted(set(masking)) or not set(masking) <= set(mine.candidates):
            raise ValueError(f"client {u}: instruction config {MASKING!r} names clients it holds no verified share of")
        if len(masking) + 1 < mine.threshold:
            raise ValueError(
                f"client {u}: it would mask with {len(masking)} neighbours, fewer than the threshold "
                f"{mine.threshold} of its neighbourhood needs"
            )
        return masking

    def encode(self, payload: Update, ctx: PluginContext) -> Update:
        """Step 2: quantize the update, add the self mask and the pairwise masks."""
        mine = self._client_round(ctx, FORWARD)
        u = ctx.client_id
        mine.masking = self._masking(mine, ctx.config, u)
        mine.shares = {w: mine.shares[w] for w in (u, *mine.masking)}
        if payload.num_examples > self.hp.max_examples:
            raise ValueError(
                f"client {u} holds {payload.num_examples} examples, more than secagg's max_examples={self.hp.max_examples}"
            )
        size = sum(t.numel() for t in payload.tensors.values() if t.is_floating_point())
        masked = np.empty(size, dtype=self.field.dtype)
        rounding = self._rounding_key(ctx.round, u)
        with self.field.workspace(size, self.quantize.real) as (stream, work):
            _, rest = flatten(payload.tensors, out=work)
            r = self.hp.clip_range
            low, high = (work.min(), work.max()) if size else (0.0, 0.0)
            if not (np.isfinite(low) and np.isfinite(high)):  # the server cannot see it once masked
                raise ValueError(f"client {u}'s update holds NaN or infinite values; it is not masked")
            if low < -r or high > r:
                clipped = int(np.count_nonzero((work > r) | (work < -r)))
                if clipped > size // 100:
                    log.warning("secagg: client %d clipped %d of %d entries to ±%g (raise clip_range)", u, clipped, size, r)
            noise = self.field.prg(rounding, stream, size)
            inside = self.quantize.inside(low, high)
            self.quantize(work, noise, work, stream[: masked.nbytes].view(masked.dtype), masked, inside)
            masked *= self.field.dtype(payload.num_examples)
            assert mine.self_seed is not None
            self.field.add_mask(masked, mine.self_seed, stream)
            for v in mine.masking:
                self.field.add_mask(masked, mine.seeds[v], stream, subtract=u > v)
        mine.self_seed, mine.seeds = None, {}  # masked: its shares are all it keeps
        mine.step = MASKED_STEP
        return replace(payload, tensors={MASKED: self.field.to_wire(self.field.reduce(masked)), **rest})

    def _rounding_key(self, rnd: int, u: int) -> bytes:
        """The PRG key of client ``u``'s stochastic rounding: fresh from ``os.urandom``, as
        rounding a value reveals where it lies between two levels; from the run seed
        (``seeded_noise``, simulation only) it repeats, and anyone with the config redraws it."""
        if not self.hp.seeded_noise:
            return os.urandom(SECRET_BYTES)
        info = f"fedweave {self.name} rounding|seed {self.seed}|round {rnd}|{u}"
        return hashlib.sha256(info.encode()).digest()[:SECRET_BYTES]

    def _client_round(self, ctx: PluginContext, step: str) -> ClientRound:
        mine = None if ctx.state is None else ctx.state.get(self.name)
        if mine is None or mine.round != ctx.round:
            raise ValueError(f"client {ctx.client_id} has no secure-aggregation set-up for round {ctx.round}")
        if mine.step != step:
            raise ValueError(f"client {ctx.client_id} is at secagg step {mine.step!r} of round {ctx.round}, not {step!r}")
        return mine

