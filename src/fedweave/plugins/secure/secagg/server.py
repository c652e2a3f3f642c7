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
from fedweave.plugins.contracts import ControlExchange, PluginContext
from fedweave.plugins.packing import combine_plain, unflatten
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
)
from fedweave.plugins.secure.secagg.masking import Field
from fedweave.plugins.secure.secagg.messages import (
    ADVERTISE,
    FORWARD,
    MASKED,
    SHARE,
    SUM,
    MASKING,
    UNMASK,
    body_tensor,
    id_list,
    ids,
    read_commitments,
    read_shares,
    u8,
)
from fedweave.plugins.secure.secagg.neighbours import threshold_of
from fedweave.plugins.secure.secagg.params import SecAggHParams
from fedweave.types import Control, Update

log = logging.getLogger(__name__)


@dataclass
class ServerRound:
    """The server's view of a round's set-up: whom each client masks with, sealed seed records, commitments."""

    round: int
    neighbours: dict[int, tuple[int, ...]]  # whom each client that may mask masks with (who holds its shares)
    threshold: dict[int, int]
    records: dict[int, bytes]  # each client that may mask, in id order -> its mask seeds sealed under r_u
    # (opened only if it drops)
    commitments: dict[int, list[list[int]]]  # its commitments to the polynomials of (r_u, b_u)
    ready: list[int]  # may send a masked update


class SecAggServer:
    """The server's steps of :class:`~fedweave.plugins.secure.secagg.SecAgg` (which sets these attributes)."""

    name: str
    hp: SecAggHParams
    field: Field
    levels: int
    round: ServerRound | None
    graph: Callable[[int, list[int]], dict[int, tuple[int, ...]]]

    def setup(self, rnd: int, cohort: list[int], exchange: ControlExchange) -> list[int]:
        """Steps 0 and 1 and the forwarding of the shares; the clients that may train and mask."""
        self.excluded = 0
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

        threshold = {u: threshold_of(self.hp.threshold, len(graph[u])) for u in members}

        def read_shares(u: int, a: Control) -> tuple[bytes, torch.Tensor, torch.Tensor, list[list[int]]]:
            shares = body_tensor(a, "shares", torch.uint8, (len(graph[u]), SEALED_SHARES))
            record = bytes(body_tensor(a, "record", torch.uint8, (1, len(graph[u]) * SECRET_BYTES + 16)))
            committed = body_tensor(a, "commitments", torch.uint8, (2, threshold[u], pedersen.ELEMENT_BYTES))
            return record, torch.from_numpy(shares), torch.from_numpy(committed), read_commitments(committed)

        replies = self._answers(rnd, exchange(asks), read_shares)
        # A client with fewer than t − 1 neighbours that shared could never be unmasked: it
        # leaves before anyone masks with it, which may thin out others' neighbourhoods.
        shared = self._thinned(rnd, {v: {u for u in graph[v] if u in replies} for v in replies}, threshold,
                               "too few neighbours shared")
        forward = {}
        for v in sorted(shared):
            senders = [u for u in graph[v] if u in shared]
            forward[v] = Control(self.name, FORWARD, {
                "senders": ids(senders),
                "shares": torch.stack([replies[u][1][graph[u].index(v)] for u in senders]),
                "commitments": torch.stack([replies[u][2] for u in senders]),
            })
        refused = self._answers(rnd, exchange(forward), lambda v, a: set(id_list(a, "refused", [u for u in graph[v] if u in shared])))
        # A pair one of whose members refused the other's shares (they did not open, or did not match the
        # commitments) does not mask; a client left with too few holders of its shares leaves the round.
        for v, bad in sorted(refused.items()):
            for u in sorted(bad):
                log.warning("round %d: client %d refused client %d's shares (they do not open or do not match "
                            "its commitments); the two do not mask with each other", rnd, v, u)
        edges = {v: {u for u in graph[v] if u in refused and u not in refused[v] and v not in refused[u]}
                 for v in refused}
        ready = self._thinned(rnd, edges, threshold, "too few neighbours hold valid shares of it")
        self.excluded = len(set(refused) - ready)
        neighbours = {v: tuple(sorted(edges[v] & ready)) for v in sorted(ready)}
        self.round = ServerRound(
            rnd, neighbours, threshold, {u: replies[u][0] for u in neighbours},
            {u: replies[u][3] for u in neighbours}, sorted(ready),
        )
        if len(ready) < 2:
            raise RoundError(f"secagg: {len(ready)} client(s) completed the key set-up; secure aggregation needs 2")
        return sorted(ready)

    def _thinned(self, rnd: int, edges: dict[int, set[int]], threshold: dict[int, int], why: str) -> set[int]:
        """The clients of ``edges`` (client -> its neighbours that may hold its shares) left once each with
        fewer than t − 1 such neighbours among those left has left, each logged with ``why``."""
        left = set(edges)
        while thin := {v for v in left if len(edges[v] & left) + 1 < threshold[v]}:
            log.warning("round %d: clients %s leave secure aggregation: %s", rnd, sorted(thin), why)
            left -= thin
        return left

    def instruct(self, ctx: PluginContext) -> dict[str, Any]:
        """Server: whom a client of the round's set-up masks with (its neighbours that stayed, no refused pair)."""
        setup = self.round
        if setup is None or setup.round != ctx.round or ctx.client_id not in setup.neighbours:
            return {}
        return {MASKING: list(setup.neighbours[ctx.client_id])}

    def metrics(self) -> dict[str, float]:
        """``secagg_excluded``: the clients the round's checks of shares excluded (dealers of shares too few
        neighbours could open or verify, holders that revealed a share their dealer did not commit to)."""
        return {"secagg_excluded": float(self.excluded)}

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
        liars: set[int] = set()
        with self.field.workspace(total.size) as (stream, _):
            for owner in survivors:
                self_seed = self._recover(ctx.round, owner, seeds.get(owner), False, liars)
                self.field.add_mask(total, self_seed, stream, subtract=True)
            for d in dropped:
                record_key = self._recover(ctx.round, d, keys.get(d), True, liars)
                try:
                    aad = associated_data("seeds", ctx.round, d, d)
                    record = open_sealed(record_key, sender_nonce(d), setup.records[d], aad, f"client {d}'s seed record")
                except ValueError as exc:
                    raise RoundError(f"{exc} with its rebuilt key") from None
                for v, seed in zip(setup.neighbours[d], _chunks(record)):
                    if v in alive:  # remove what v added for the pair (v, d): +PRG(s_vd) when v < d
                        self.field.add_mask(total, seed, stream, subtract=v < d)
        self.excluded += len(liars)
        plain = combine_plain([{k: t for k, t in u.tensors.items() if k != MASKED} for u in updates])
        return Update(
            kind=updates[0].kind,
            tensors={SUM: self.field.to_wire(self.field.reduce(total)), **plain},
            num_examples=examples,
            applied=list(updates[0].applied),
        )

    def _collect(
        self, rnd: int, answers: dict[int, Control], asked: dict[int, list[int]], gone: dict[int, list[int]]
    ) -> tuple[dict[int, list[tuple[int, shamir.Share]]], dict[int, list[tuple[int, shamir.Share]]]]:
        """The shares each survivor answered, by owner: of b_w for itself and the survivors it
        was ``asked`` about, of r_w for its neighbours ``gone`` after step 1."""
        seeds: dict[int, list[tuple[int, shamir.Share]]] = {}
        keys: dict[int, list[tuple[int, shamir.Share]]] = {}
        for v, reply in sorted(answers.items()):
            owners = sorted([v, *asked[v]])
            try:
                seed_rows = body_tensor(reply, "seed", torch.uint8, (len(owners), SHARE_BYTES))
                key_rows = body_tensor(reply, "key", torch.uint8, (len(gone[v]), SHARE_BYTES))
                seed_shares = [read_shares(bytes(row))[0] for row in seed_rows]
                key_shares = [read_shares(bytes(row))[0] for row in key_rows]
            except ValueError as exc:
                log.warning("round %d: client %d's unmasking answer refused: %s", rnd, v, exc)
                continue
            for w, share in zip(owners, seed_shares):
                seeds.setdefault(w, []).append((v + 1, share))
            for w, share in zip(gone[v], key_shares):
                keys.setdefault(w, []).append((v + 1, share))
        return seeds, keys

    def _recover(
        self, rnd: int, owner: int, shares: list[tuple[int, shamir.Share]] | None, dropped: bool, liars: set[int]
    ) -> bytes:
        """``owner``'s record key (``dropped``) or self-mask seed from the threshold of its ``shares`` (point,
        share), leaving out those of ``liars``. Checked against ``owner``'s commitment: when the shares
        interpolate to another secret, each is checked against ``owner``'s commitments, and a holder whose
        share fails is named, added to ``liars`` and left out, here and for every later secret."""
        setup = self._server_round(rnd)
        need, which = setup.threshold[owner], int(not dropped)
        committed = setup.commitments[owner][which]
        shares = [(x, share) for x, share in shares or [] if x - 1 not in liars]
        _enough(owner, len(shares), need, dropped, "answered")
        secret = shamir.combine([x for x, _ in shares[:need]], [share for _, share in shares[:need]])
        if not shamir.opens(secret, committed[0]):
            what = "record key" if dropped else "self-mask seed"
            for x, share in shares:
                if not shamir.verify(x, share, committed):
                    log.warning("round %d: client %d revealed a share of client %d's %s that does not match its "
                                "commitments; its shares are left out", rnd, x - 1, owner, what)
                    liars.add(x - 1)
            shares = [(x, share) for x, share in shares if x - 1 not in liars]
            _enough(owner, len(shares), need, dropped, "answered with valid shares")
            secret = shamir.combine([x for x, _ in shares[:need]], [share for _, share in shares[:need]])
        # an honest dealer's secret is 16 bytes; a dealer that shared another one only spoils its own mask
        return (secret[0] % (1 << (8 * SECRET_BYTES))).to_bytes(SECRET_BYTES, "big")

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
