"""Secure aggregation with pairwise and self masks: the server learns only the sum.

Bonawitz et al., "Practical Secure Aggregation for Privacy-Preserving Machine Learning",
CCS 2017 (https://eprint.iacr.org/2017/281); the sparse neighbourhoods of SecAgg+ from
Bell et al., "Secure Single-Server Aggregation with (Poly)Logarithmic Overhead", CCS 2020
(https://eprint.iacr.org/2020/704).

**Encoding (client u).** The floating tensors of the update, flattened, are clipped to
[−R, R] and quantized with stochastic rounding to integers x ∈ [0, L], L = 2^q − 1,
where q = bits − ⌈log2 max_examples⌉; the client multiplies by its example count n_u,
so that the field sum Σ n_u x_u of a round with at most ``max_examples`` examples never
wraps. Then, in the field of integers mod 2^bits,

    y_u = n_u x_u + PRG(b_u) + Σ_{v ∈ N(u), v > u} PRG(s_uv) − Σ_{v ∈ N(u), v < u} PRG(s_uv)

where b_u is a fresh random self-mask seed, N(u) the client's neighbours (every other
client for SecAgg; ``neighbours`` of them on a ring over a random permutation of the
round's cohort for SecAgg+), and s_uv = HKDF-SHA256(X25519(sk_u, pk_v)) the seed both
ends of a pair derive from their key agreement. PRG is AES-256-CTR keyed by the seed.
y_u is uniform in the field whatever the update: the server learns nothing from it.

**Combining (server).** Pairwise masks cancel in the sum of every pair that both sent.
For each client that sent, the server asks its surviving neighbours for their Shamir
shares of b_u (threshold t of the neighbourhood) and removes PRG(b_u); for each client
that dropped after the set-up, it asks for the shares of its secret key sk_d, recomputes
s_dv for its surviving neighbours v and removes those masks. It never asks for both
secrets of one client. Fewer than t surviving holders of a needed secret raise
:class:`~fedweave.errors.RoundError`, which the loop turns into a skipped round.

**Message flow.** A deployment runs, per round: (0) the server asks the cohort to
advertise keys and each client answers with its public keys; (1) the server forwards the
key list, each client Shamir-shares sk_u and b_u to its neighbours, encrypted for each
of them, through the server; (2) the training exchange, whose reply is y_u (this
plugin's ``encode``); (3) the server sends the list of survivors and each survivor
answers with the shares asked for. fedweave's round has one exchange, so in
simulation steps 0, 1 and 3 run inside the plugin (``begin_round`` and ``combine``, with
one :class:`ClientSecrets` per client standing for the client), and only step 2's masked
vector crosses the transport — an int32 (bits ≤ 32) or int64 tensor, so any transport
carries it and its bytes are counted. Key and share traffic (a few hundred bytes per
neighbour) is not.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from fedweave.errors import ConfigError, RoundError
from fedweave.plugins.chain import PluginContext
from fedweave.plugins.packing import combine_plain, flatten, unflatten
from fedweave.plugins.secure import shamir
from fedweave.schema import opt
from fedweave.seeding import numpy_rng
from fedweave.types import Update, UpdateKind

log = logging.getLogger(__name__)

MASKED = "__secagg_masked"
SUM = "__secagg_sum"


@dataclass
class SecAggParams:
    neighbours: int | None = opt(
        None, ge=2, help="SecAgg+: each client masks with this many others (none: all others, as in SecAgg)"
    )
    threshold: float = opt(
        0.6, gt=0.5, le=1, help="share t of a neighbourhood (the client included) that must survive to unmask it"
    )
    bits: int = opt(32, ge=16, le=64, help="updates are summed in the integers mod 2^bits (wire: 4 bytes up to 32)")
    clip_range: float = opt(4.0, gt=0, help="R: entries are clipped to [-R, R] before quantization")
    max_examples: int = opt(65536, ge=1, help="most training examples a round's updates hold together")

    def validate(self, prefix: str) -> None:
        if self.bits - math.ceil(math.log2(self.max_examples)) < 8:
            raise ConfigError(
                f"config key '{prefix}.max_examples': {self.max_examples} leaves fewer than 8 bits of precision "
                f"in a field of {self.bits} bits; raise bits or lower max_examples"
            )


@functools.cache
def _crypto() -> Any:
    try:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    except ImportError:
        raise ImportError("plugin 'secagg' needs cryptography: pip install 'fedweave[privacy]'") from None
    return hashes, X25519PrivateKey, X25519PublicKey, Cipher, algorithms, modes, HKDF


class Field:
    """The integers mod 2^bits as numpy arrays (uint32 up to 32 bits, else uint64; wrap-around is the modulus)."""

    def __init__(self, bits: int):
        self.bits = bits
        self.dtype = np.uint32 if bits <= 32 else np.uint64
        self.wire = torch.int32 if bits <= 32 else torch.int64
        self.mask = self.dtype((1 << bits) - 1)
        self._buffer = np.empty(0, dtype=np.uint8)

    def add_mask(self, acc: np.ndarray, seed: bytes, subtract: bool = False) -> None:
        """``acc`` ± PRG(seed) in place, PRG being AES-256-CTR keyed by ``seed``.

        Arithmetic wraps mod 2^32 or 2^64, a multiple of 2^bits, so reducing once at the
        end gives the same residue as reducing every mask.
        """
        _, _, _, Cipher, algorithms, modes, _ = _crypto()
        nbytes = acc.nbytes
        if self._buffer.size != nbytes + 15:  # update_into wants room for one block more
            self._buffer = np.empty(nbytes + 15, dtype=np.uint8)
        Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor().update_into(_zeros(nbytes), self._buffer)
        values = self._buffer[:nbytes].view(self.dtype)
        if subtract:
            acc -= values
        else:
            acc += values

    def reduce(self, values: np.ndarray) -> np.ndarray:
        return values & self.mask

    def to_wire(self, values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(values.view(np.int32 if self.bits <= 32 else np.int64).copy())

    def from_wire(self, tensor: torch.Tensor) -> np.ndarray:
        return tensor.numpy().view(self.dtype)


@functools.lru_cache(maxsize=4)
def _zeros(nbytes: int) -> bytes:
    return bytes(nbytes)


def derive_seed(shared: bytes, round_: int) -> bytes:
    """HKDF-SHA256 of an X25519 shared secret: the pair's 32-byte mask seed for a round."""
    hashes, _, _, _, _, _, HKDF = _crypto()
    info = f"fedweave secagg pairwise mask, round {round_}".encode()
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(shared)


class ClientSecrets:
    """What one client holds for one round: its keys, self-mask seed and the shares it received."""

    def __init__(self, client_id: int):
        _, X25519PrivateKey, _, _, _, _, _ = _crypto()
        self.client_id = client_id
        self.key = X25519PrivateKey.generate()
        self.self_seed = os.urandom(32)
        self.public = self.key.public_key().public_bytes_raw()
        self.shares: dict[int, tuple[shamir.Share, shamir.Share]] = {}  # owner -> (of sk, of b)

    def share_out(self, holders: list[int], threshold: int) -> dict[int, tuple[shamir.Share, shamir.Share]]:
        """Shamir shares of this client's secret key and self-mask seed, one pair per holder."""
        xs = [h + 1 for h in holders]
        key_shares = shamir.split(shamir.to_int(self.key.private_bytes_raw()), threshold, xs)
        seed_shares = shamir.split(shamir.to_int(self.self_seed), threshold, xs)
        return {h: (key_shares[h + 1], seed_shares[h + 1]) for h in holders}

    def reveal(self, owner: int, dropped: bool) -> shamir.Share:
        """Step 3: the share of ``owner``'s secret key if it dropped, else of its self-mask seed."""
        key_share, seed_share = self.shares[owner]
        return key_share if dropped else seed_share


@dataclass
class RoundSetup:
    """The server's view of a round's set-up: cohort, graph, public keys, thresholds."""

    round: int
    neighbours: dict[int, list[int]]
    public: dict[int, Any]  # X25519 public keys
    threshold: dict[int, int]
    clients: dict[int, ClientSecrets]  # in simulation: the clients' own state


class SecAgg:
    """Secure aggregation, SecAgg+ style: pairwise and self masks, Shamir recovery of drop-outs."""

    name = "secagg"
    Params = SecAggParams
    accepts = frozenset(UpdateKind)
    combines_encoded = True
    stage = "secure"
    points = ("client_send",)
    one_process = "its key set-up and unmasking exchanges run inside the plugin"

    def __init__(self, hp: SecAggParams):
        self.hp = hp
        self.field = Field(hp.bits)
        self.levels = (1 << (hp.bits - math.ceil(math.log2(hp.max_examples)))) - 1
        self.seed = 0
        self.setup: RoundSetup | None = None

    def bind(self, config: Any) -> None:
        self.seed = config.seed

    # ------------------------------------------------- steps 0 and 1: key set-up

    def begin_round(self, rnd: int, client_ids: list[int]) -> None:
        """Advertise keys and share secrets among the round's cohort (simulated; see the module doc)."""
        cohort = sorted(set(client_ids))
        graph = self.graph(rnd, cohort)
        clients = {u: ClientSecrets(u) for u in cohort}
        threshold = {u: math.ceil(self.hp.threshold * (len(graph[u]) + 1)) for u in cohort}
        for u in cohort:
            for holder, pair in clients[u].share_out([u, *graph[u]], threshold[u]).items():
                clients[holder].shares[u] = pair
        public = {u: _public_key(c.public) for u, c in clients.items()}  # as each client parses the key list
        self.setup = RoundSetup(rnd, graph, public, threshold, clients)

    def graph(self, rnd: int, cohort: list[int]) -> dict[int, list[int]]:
        """Each client's masking neighbours: all others, or a ring over a seeded permutation (SecAgg+)."""
        n = len(cohort)
        if self.hp.neighbours is None or self.hp.neighbours >= n - 1:
            return {u: [v for v in cohort if v != u] for u in cohort}
        order = [cohort[i] for i in numpy_rng(self.seed, self.name, "graph", rnd).permutation(n)]
        half = math.ceil(self.hp.neighbours / 2)
        if 2 * half >= n - 1:
            return {u: [v for v in cohort if v != u] for u in cohort}
        out = {}
        for i, u in enumerate(order):
            out[u] = sorted(order[(i + d) % n] for d in range(-half, half + 1) if d)
        return out

    # ------------------------------------------------------ step 2: masked input

    def encode(self, payload: Update, ctx: PluginContext) -> Update:
        setup = self._setup(ctx.round)
        u = ctx.client_id
        if u not in setup.clients:
            raise ValueError(f"client {u} is not in round {ctx.round}'s secure-aggregation cohort")
        if payload.num_examples > self.hp.max_examples:
            raise ValueError(
                f"client {u} holds {payload.num_examples} examples, more than secagg's max_examples={self.hp.max_examples}"
            )
        vector, rest = flatten(payload.tensors)
        real = np.float32 if self.levels < 2**24 else np.float64  # float32 resolves 2^-8 of a step at worst
        x = vector.numpy().astype(real)
        r = self.hp.clip_range
        clipped = int(np.count_nonzero(np.abs(x) > r))
        if clipped > x.size // 100:
            log.warning("secagg: client %d clipped %d of %d entries to ±%g (raise clip_range)", u, clipped, x.size, r)
        scaled = (np.clip(x, -r, r) + r) * real(self.levels / (2 * r))
        lower = np.floor(scaled)
        up = numpy_rng(self.seed, self.name, ctx.round, u).random(x.size, dtype=real) < scaled - lower
        masked = np.minimum(lower + up, self.levels).astype(self.field.dtype)  # stochastic rounding
        masked *= self.field.dtype(payload.num_examples)
        secrets = setup.clients[u]
        self.field.add_mask(masked, secrets.self_seed)
        for v in setup.neighbours[u]:
            seed = derive_seed(secrets.key.exchange(setup.public[v]), ctx.round)
            self.field.add_mask(masked, seed, subtract=u > v)
        tensors = {MASKED: self.field.to_wire(self.field.reduce(masked)), **rest}
        return replace(payload, tensors=tensors)

    # --------------------------------------------------- step 3: unmasking the sum

    def combine(self, updates: list[Update], ctx: PluginContext) -> Update:
        setup = self._setup(ctx.round)
        survivors = [u.client_id for u in updates]
        if len(set(survivors)) != len(survivors) or not set(survivors) <= set(setup.clients):
            raise RoundError(f"secagg: round {ctx.round}'s updates do not come from distinct members of its cohort")
        examples = sum(u.num_examples for u in updates)
        if examples > self.hp.max_examples:
            raise RoundError(
                f"secagg: the round's updates hold {examples} examples, more than max_examples="
                f"{self.hp.max_examples}, so their field sum may have wrapped"
            )
        alive = set(survivors)
        dropped = sorted(set(setup.clients) - alive)
        total = self.field.from_wire(updates[0].tensors[MASKED]).copy()
        for u in updates[1:]:
            total += self.field.from_wire(u.tensors[MASKED])
        for u in survivors:
            self.field.add_mask(total, shamir.to_bytes(self._recover(setup, u, alive, dropped=False)), subtract=True)
        _, X25519PrivateKey, _, _, _, _, _ = _crypto()
        for d in dropped:
            key = X25519PrivateKey.from_private_bytes(shamir.to_bytes(self._recover(setup, d, alive, dropped=True)))
            for v in setup.neighbours[d]:
                if v in alive:
                    seed = derive_seed(key.exchange(setup.public[v]), ctx.round)
                    self.field.add_mask(total, seed, subtract=v < d)  # remove what v added for the pair (v, d)
        plain = combine_plain([{k: t for k, t in u.tensors.items() if k != MASKED} for u in updates])
        return Update(
            kind=updates[0].kind,
            tensors={SUM: self.field.to_wire(self.field.reduce(total)), **plain},
            num_examples=examples,
            applied=list(updates[0].applied),
        )

    def decode(self, payload: Update, ctx: PluginContext) -> Update:
        """Dequantize the unmasked sum Σ n_u x_u into the example-weighted mean of the updates."""
        if SUM not in payload.tensors:
            raise ValueError("secagg decodes only the server's combined sum, never one client's masked update")
        rest = {k: v for k, v in payload.tensors.items() if k != SUM}
        total = self.field.from_wire(payload.tensors[SUM]).astype(np.float64)
        n, r = payload.num_examples, self.hp.clip_range
        mean = (total / self.levels * (2 * r) - r * n) / n
        return replace(payload, tensors=unflatten(torch.from_numpy(mean), rest))

    # ----------------------------------------------------------------- helpers

    def _setup(self, rnd: int) -> RoundSetup:
        if self.setup is None or self.setup.round != rnd:
            raise ValueError(f"secagg has no key set-up for round {rnd} (begin_round was not called)")
        return self.setup

    def _recover(self, setup: RoundSetup, owner: int, alive: set[int], dropped: bool) -> int:
        """Ask ``owner``'s surviving share holders for their shares; interpolate its secret."""
        holders = [h for h in [owner, *setup.neighbours[owner]] if h in alive]
        need = setup.threshold[owner]
        if len(holders) < need:
            what = "secret key" if dropped else "self-mask seed"
            raise RoundError(
                f"secagg: only {len(holders)} of client {owner}'s share holders survived, its {what} needs "
                f"{need} (threshold); the sum cannot be unmasked"
            )
        return shamir.combine([setup.clients[h].reveal(owner, dropped) for h in holders[:need]])


def _public_key(raw: bytes) -> Any:
    _, _, X25519PublicKey, _, _, _, _ = _crypto()
    return X25519PublicKey.from_public_bytes(raw)
