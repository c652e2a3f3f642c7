"""SecAgg's server half: the key set-up (steps 0, 1 and the forwarding of the shares), the
unmasking (step 3) and the decoding of the sum. It holds no client secret: only public keys,
sealed seed records and the shares survivors reveal to unmask."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from fedweave.errors import RoundError
from fedweave.plugins.chain import ControlExchange, PluginContext
from fedweave.plugins.packing import combine_plain, unflatten
from fedweave.plugins.secure import shamir
from fedweave.plugins.secure.secagg.keys import (
    KEY_BYTES,
    SEALED_SHARES,
    SECRET_BYTES,
    SECRET_LIMBS,
    associated_data,
    crypto,
    sender_nonce,
    open_sealed,
    public_key,
)
from fedweave.plugins.secure.secagg.masking import Field
from fedweave.plugins.secure.secagg.messages import (
    ADVERTISE,
    FORWARD,
    MASKED,
    SHARE,
    SUM,
    UNMASK,
    ids,
    body_tensor,
    u8,
)
from fedweave.plugins.secure.secagg.neighbours import threshold_of
from fedweave.plugins.secure.secagg.params import SecAggParams
from fedweave.types import Control, Update

log = logging.getLogger(__name__)


@dataclass
class ServerRound:
    """The server's view of a round's set-up: public keys, sealed seed records, who did what."""

    round: int
    neighbours: dict[int, tuple[int, ...]]
    threshold: dict[int, int]
    records: dict[int, bytes]  # who completed step 1 (its neighbours mask with it), in id order ->
    # its mask seeds sealed under r_u (opened only if it drops)
    ready: list[int]  # received its neighbours' shares: may send a masked update


class SecAggServer:
    """The server's steps of :class:`~fedweave.plugins.secure.secagg.SecAgg` (which sets these attributes)."""

    name: str
    hp: SecAggParams
    field: Field
    levels: int
    round: ServerRound | None
    graph: Callable[[int, list[int]], dict[int, tuple[int, ...]]]

    def setup(self, rnd: int, cohort: list[int], exchange: ControlExchange) -> list[int]:
        """Steps 0 and 1 and the forwarding of the shares; the clients that may train and mask."""
        probe = crypto().PrivateKey.generate()

        def read_key(u: int, a: Control) -> bytes:
            raw = bytes(body_tensor(a, "key", torch.uint8, (1, KEY_BYTES)))
            try:  # a low-order point would break every agreement with it: refused here, once
                probe.exchange(public_key(raw))
            except ValueError:
                raise ValueError("its public key is not a valid X25519 point") from None
            return raw

        public = self._answers(rnd, exchange({u: Control(self.name, ADVERTISE) for u in sorted(set(cohort))}), read_key)
        members = sorted(public)
        if len(members) < 2:
            raise RoundError(f"secagg: {len(members)} client(s) advertised keys; secure aggregation needs 2")
        graph = self.graph(rnd, members)
        asks = {
            u: Control(self.name, SHARE, {"cohort": ids(members), "keys": u8([public[v] for v in graph[u]], KEY_BYTES)})
            for u in members
        }

        def read_shares(u: int, a: Control) -> tuple[bytes, torch.Tensor]:
            shares = body_tensor(a, "shares", torch.uint8, (len(graph[u]), SEALED_SHARES))
            return bytes(body_tensor(a, "record", torch.uint8, (1, len(graph[u]) * SECRET_BYTES + 16))), torch.from_numpy(shares)

        replies = self._answers(rnd, exchange(asks), read_shares)
        threshold = {u: threshold_of(self.hp.threshold, len(graph[u])) for u in members}
        # A client with fewer than t − 1 neighbours that shared could never be unmasked: it
        # leaves before anyone masks with it, which may thin out others' neighbourhoods.
        shared = set(replies)
        while thin := {v for v in shared if sum(u in shared for u in graph[v]) + 1 < threshold[v]}:
            log.warning("round %d: clients %s leave secure aggregation: too few neighbours shared", rnd, sorted(thin))
            shared -= thin
        forward = {}
        for v in sorted(shared):
            senders = [(u, replies[u][1][graph[u].index(v)]) for u in graph[v] if u in shared]
            forward[v] = Control(self.name, FORWARD, {
                "senders": ids([u for u, _ in senders]), "shares": torch.stack([row for _, row in senders])
            })
        ready = sorted(self._answers(rnd, exchange(forward), lambda u, a: None))
        records = {u: replies[u][0] for u in sorted(shared)}
        self.round = ServerRound(rnd, graph, threshold, records, ready)
        if len(ready) < 2:
            raise RoundError(f"secagg: {len(ready)} client(s) completed the key set-up; secure aggregation needs 2")
        return ready

    def _answers(self, rnd: int, answers: dict[int, Control], read: Any) -> dict[int, Any]:
        """``read(client, answer)`` of each answer; a malformed one drops its client (logged)."""
        out = {}
        for u, a in sorted(answers.items()):
            try:
                out[u] = read(u, a)
            except ValueError as exc:
                log.warning("round %d: client %d leaves secure aggregation: %s", rnd, u, exc)
        return out

    def combine(self, updates: list[Update], ctx: PluginContext, exchange: ControlExchange) -> Update:
        """Step 3: sum the masked updates, ask the survivors for shares, remove the masks."""
        setup = self._server_round(ctx.round)
        survivors = sorted(u.client_id for u in updates)
        if len(set(survivors)) != len(survivors) or not set(survivors) <= set(setup.ready):
            raise RoundError(f"secagg: round {ctx.round}'s updates do not come from distinct members of its cohort")
        examples = sum(u.num_examples for u in updates)
        if examples > self.hp.max_examples:
            raise RoundError(
                f"secagg: the round's updates hold {examples} examples, more than max_examples="
                f"{self.hp.max_examples}, so their field sum may have wrapped"
            )
        alive = set(survivors)
        dropped = [d for d in setup.records if d not in alive]
        for owner in [*survivors, *dropped]:
            holders = [h for h in (owner, *setup.neighbours[owner]) if h in alive]
            _enough(owner, len(holders), setup.threshold[owner], owner not in alive, "survived")
        asked = {v: [w for w in setup.neighbours[v] if w in alive] for v in survivors}
        lost = set(dropped)
        gone = {v: [w for w in setup.neighbours[v] if w in lost] for v in survivors}
        answers = exchange({v: Control(self.name, UNMASK, {"survivors": ids(asked[v])}) for v in survivors})
        seeds, keys = self._collect(ctx.round, answers, asked, gone)
        total = self.field.from_wire(updates[0].tensors[MASKED]).copy()
        for u in updates[1:]:
            np.add(total, self.field.from_wire(u.tensors[MASKED]), out=total)
        with self.field.workspace(total.size) as (stream, _):
            for owner in survivors:
                self_seed = _recover(owner, seeds.get(owner), setup.threshold[owner], False)
                self.field.add_mask(total, self_seed, stream, subtract=True)
            for d in dropped:
                record_key = _recover(d, keys.get(d), setup.threshold[d], True)
                try:
                    aad = associated_data("seeds", ctx.round, d, d)
                    record = open_sealed(record_key, sender_nonce(d), setup.records[d], aad, f"client {d}'s seed record")
                except ValueError as exc:
                    raise RoundError(f"{exc} with its rebuilt key") from None
                for v, seed in zip(setup.neighbours[d], _chunks(record)):
                    if v in alive:  # remove what v added for the pair (v, d): +PRG(s_vd) when v < d
                        self.field.add_mask(total, seed, stream, subtract=v < d)
        plain = combine_plain([{k: t for k, t in u.tensors.items() if k != MASKED} for u in updates])
        return Update(
            kind=updates[0].kind,
            tensors={SUM: self.field.to_wire(self.field.reduce(total)), **plain},
            num_examples=examples,
            applied=list(updates[0].applied),
        )

    def _collect(
        self, rnd: int, answers: dict[int, Control], asked: dict[int, list[int]], gone: dict[int, list[int]]
    ) -> tuple[dict[int, list[tuple[int, np.ndarray]]], dict[int, list[tuple[int, np.ndarray]]]]:
        """The shares each survivor answered, by owner: of b_w for itself and the survivors it
        was ``asked`` about, of r_w for its neighbours ``gone`` after step 1."""
        seeds: dict[int, list[tuple[int, np.ndarray]]] = {}
        keys: dict[int, list[tuple[int, np.ndarray]]] = {}
        for v, reply in sorted(answers.items()):
            owners = sorted([v, *asked[v]])
            try:
                seed_rows = body_tensor(reply, "seed", torch.int32, (len(owners), SECRET_LIMBS))
                key_rows = body_tensor(reply, "key", torch.int32, (len(gone[v]), SECRET_LIMBS))
            except ValueError as exc:
                log.warning("round %d: client %d's unmasking answer refused: %s", rnd, v, exc)
                continue
            for w, row in zip(owners, seed_rows):
                seeds.setdefault(w, []).append((v + 1, row))
            for w, row in zip(gone[v], key_rows):
                keys.setdefault(w, []).append((v + 1, row))
        return seeds, keys

    def decode(self, payload: Update, ctx: PluginContext) -> Update:
        """Dequantize the unmasked sum Σ n_u x_u into the example-weighted mean of the updates."""
        if SUM not in payload.tensors:
            raise ValueError("secagg decodes only the server's combined sum, never one client's masked update")
        rest = {k: v for k, v in payload.tensors.items() if k != SUM}
        total = self.field.from_wire(payload.tensors[SUM]).astype(np.float64)
        n, r = payload.num_examples, self.hp.clip_range
        mean = (total / self.levels * (2 * r) - r * n) / n
        return replace(payload, tensors=unflatten(torch.from_numpy(mean), rest))

    def _server_round(self, rnd: int) -> ServerRound:
        if self.round is None or self.round.round != rnd:
            raise RoundError(f"secagg has no key set-up for round {rnd} (setup was not run)")
        return self.round


def _chunks(record: bytes) -> list[bytes]:
    return [record[i : i + SECRET_BYTES] for i in range(0, len(record), SECRET_BYTES)]


def _enough(owner: int, count: int, need: int, dropped: bool, verb: str) -> None:
    if count < need:
        what = "record key" if dropped else "self-mask seed"
        raise RoundError(
            f"secagg: only {count} of client {owner}'s share holders {verb}, its {what} needs {need} "
            "(threshold); the sum cannot be unmasked"
        )


def _recover(owner: int, shares: list[tuple[int, np.ndarray]] | None, need: int, dropped: bool) -> bytes:
    """Interpolate ``owner``'s record key (``dropped``) or self-mask seed from ``need`` of its ``shares``."""
    shares = shares or []
    _enough(owner, len(shares), need, dropped, "answered")
    limbs = shamir.combine([x for x, _ in shares[:need]], np.stack([row for _, row in shares[:need]]))
    try:
        return shamir.from_limbs(limbs)[0]
    except ValueError as exc:
        raise RoundError(f"secagg: client {owner}'s shares are inconsistent ({exc})") from None
