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

where b_u is a fresh random self-mask seed, N(u) the client's neighbours that completed
the key set-up (every other client for SecAgg; ``neighbours`` of them on a ring over a
seeded permutation of the round's cohort for SecAgg+), and s_uv the pair's mask seed.
PRG is AES-128-CTR keyed by the seed, one call over the whole vector. Every secret of
the protocol (b_u, the record key r_u, c_uv, s_uv) is 16 bytes: X25519 gives 128-bit
security, so wider keys would add work (10–25 % more masking time for AES-256, twice
the Shamir shares) and nothing else. y_u is uniform in the field whatever the update: the server learns
nothing from it.

**Messages** (:class:`~fedweave.types.Control` bodies through the round's topology; the
server half is :meth:`SecAgg.setup` and :meth:`SecAgg.combine`, the client half
:meth:`SecAgg.answer` and :meth:`SecAgg.encode`, whose secrets live in the client's
private state, ``ctx.state``, and never leave its process):

0. ``advertise``: each client makes a fresh X25519 key pair (k_u, K_u), a self-mask seed
   b_u and a record key r_u; it answers its public key K_u.
1. ``share``: the server sends each client the cohort and its neighbours' public keys.
   The client derives, once per pair, X25519(k_u, K_v) and from it one HKDF-SHA256 output
   whose halves are two independent keys: the channel key c_uv and the mask seed s_uv.
   It answers (a) its mask seeds, sealed with AES-128-GCM under r_u (the *seed record*,
   which the server keeps and cannot open), and (b) for each neighbour, its Shamir
   shares of r_u and b_u (threshold t of its neighbourhood, itself included), sealed with
   AES-128-GCM under c_uv (round, sender and receiver bound to each). One agreement per pair serves the
   channel and the mask; what a drop-out's shares reveal, r_d, opens its mask seeds and
   never its channel keys, so the shares of b_d it sent stay sealed (as the second key
   pair of the paper ensures there).
2. ``forward``: the server forwards each client the shares addressed to it by the
   neighbours that completed step 1; the client opens and keeps them, and masks only
   with those neighbours. Then the training exchange, whose reply is y_u (:meth:`encode`).
3. ``unmask``: the server sends each client whose y_u arrived the survivors among its
   neighbours; it answers its shares of b_w for the survivors (itself included) and of
   r_w for the neighbours that dropped: never both for one client, and only once.

**Combining (server).** Pairwise masks cancel in the sum of every pair that both sent;
the server removes PRG(b_u) of every survivor, and for each client d that dropped after
step 1 it rebuilds r_d, opens d's seed record and removes the masks s_dv of d's
surviving neighbours. Clients that drop before step 1 are not in the round. Fewer than t
surviving (or answering) holders of a needed secret raise
:class:`~fedweave.errors.RoundError`, which the loop turns into a skipped round.

The server is honest but curious: it follows the protocol (it forwards the public keys
it received); the consistency checks and signatures of the paper's malicious model are
not implemented.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from fedweave.errors import ConfigError, RoundError
from fedweave.plugins.chain import ControlExchange, PluginContext
from fedweave.plugins.packing import combine_plain, flatten, unflatten
from fedweave.plugins.secure import shamir
from fedweave.schema import opt
from fedweave.seeding import numpy_rng
from fedweave.types import Control, Update, UpdateKind

log = logging.getLogger(__name__)

MASKED = "__secagg_masked"
SUM = "__secagg_sum"

ADVERTISE, SHARE, FORWARD, UNMASK = "advertise", "share", "forward", "unmask"
MASKED_STEP = "masked"  # a client's state once it sent y_u (not a message)

KEY_BYTES = 32  # an X25519 public key
SECRET_BYTES = 16  # b_u, r_u, c_uv, s_uv: AES-128 keys, the 128-bit security of X25519
SECRET_LIMBS = SECRET_BYTES * 8 // shamir.LIMB_BITS
SEALED_SHARES = 2 * SECRET_LIMBS * 4 + 16  # shares of r_u and b_u as uint32 limbs, and the GCM tag


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
    seeded_noise: bool = opt(
        False,
        help="draw the stochastic rounding from the run seed (reproducible; simulation only: anyone with the "
        "config can redraw it)",
    )

    def validate(self, prefix: str) -> None:
        if self.bits - math.ceil(math.log2(self.max_examples)) < 8:
            raise ConfigError(
                f"config key '{prefix}.max_examples': {self.max_examples} leaves fewer than 8 bits of precision "
                f"in a field of {self.bits} bits; raise bits or lower max_examples"
            )


@functools.cache
def _crypto() -> Any:
    try:
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError:
        raise ImportError("plugin 'secagg' needs cryptography: pip install 'fedweave[privacy]'") from None
    return SimpleNamespace(
        InvalidTag=InvalidTag,
        PrivateKey=X25519PrivateKey,
        PublicKey=X25519PublicKey,
        Cipher=Cipher,
        AES128=algorithms.AES128,
        CTR=modes.CTR(bytes(16)),
        AESGCM=AESGCM,
    )


def hkdf(secret: bytes, *infos: bytes) -> list[bytes]:
    """HKDF-SHA256 (RFC 5869) without salt: one 32-byte output per ``info``, from one extraction."""
    prk = hmac.digest(bytes(32), secret, "sha256")
    return [hmac.digest(prk, info + b"\x01", "sha256") for info in infos]


def pair_info(rnd: int, u: int, v: int) -> bytes:
    """HKDF's context for a pair's keys: the round, the pair (in either order)."""
    return f"fedweave secagg pair|round {rnd}|{min(u, v)}|{max(u, v)}".encode()


def _aad(what: str, rnd: int, sender: int, receiver: int) -> bytes:
    return f"fedweave secagg {what}|round {rnd}|{sender}->{receiver}".encode()


def _nonce(sender: int) -> bytes:
    # Every GCM key here (a pair's channel key, a record key) is fresh for the round and
    # encrypts once per sender.
    return sender.to_bytes(12, "big")


def _open(key: bytes, nonce: bytes, sealed: bytes, aad: bytes, what: str) -> bytes:
    c = _crypto()
    try:
        return c.AESGCM(key).decrypt(nonce, sealed, aad)
    except c.InvalidTag:
        raise ValueError(f"secagg: {what} does not authenticate") from None


class Field:
    """The integers mod 2^bits as numpy arrays (uint32 up to 32 bits, else uint64; wrap-around is the modulus).

    It keeps two buffers, reused across calls (a fresh 400 KB array costs its page faults
    every time): the PRG's output and a real work vector for quantization. Both are
    wiped when a :meth:`workspace` ends, so no keystream or plaintext outlives its call.
    """

    def __init__(self, bits: int):
        self.bits = bits
        self.dtype = np.uint32 if bits <= 32 else np.uint64
        self.width = np.dtype(self.dtype).itemsize * 8
        self.mask = self.dtype((1 << bits) - 1)
        self._stream = np.empty(0, dtype=np.uint8)
        self._work = np.empty(0, dtype=np.float64)

    @contextlib.contextmanager
    def workspace(self, size: int, real: Any = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The PRG buffer (``size`` entries and one AES block more) and a work vector of
        ``real`` (none, an empty one, when ``real`` is None: the server unmasks without)."""
        nbytes = size * (self.width // 8) + 15
        if self._stream.size != nbytes:
            self._stream = np.empty(nbytes, dtype=np.uint8)
        if real is not None and (self._work.size != size or self._work.dtype != real):
            self._work = np.empty(size, dtype=real)
        work = self._work if real is not None else self._work[:0]
        try:
            yield self._stream, work
        finally:
            self._stream.fill(0)
            work.fill(0)

    def prg(self, seed: bytes, stream: np.ndarray, nbytes: int | None = None) -> np.ndarray:
        """PRG(seed): AES-128-CTR keyed by the 16-byte ``seed``, one call, written into
        ``stream``: a field entry for each entry of the workspace, or ``nbytes`` uniform bytes."""
        c = _crypto()
        whole = nbytes is None
        nbytes = stream.size - 15 if nbytes is None else nbytes
        c.Cipher(c.AES128(seed), c.CTR).encryptor().update_into(_zeros(nbytes), stream[: nbytes + 15])
        return stream[:nbytes].view(self.dtype) if whole else stream[:nbytes]

    def add_mask(self, acc: np.ndarray, seed: bytes, stream: np.ndarray, subtract: bool = False) -> None:
        """``acc`` ± PRG(seed) in place. Arithmetic wraps mod 2^32 or 2^64, a multiple of
        2^bits, so reducing once at the end gives the same residue as reducing every mask."""
        values = self.prg(seed, stream)
        if subtract:
            np.subtract(acc, values, out=acc)
        else:
            np.add(acc, values, out=acc)

    def reduce(self, values: np.ndarray) -> np.ndarray:
        if self.bits < self.width:
            np.bitwise_and(values, self.mask, out=values)
        return values

    def to_wire(self, values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(values.view(np.int32 if self.bits <= 32 else np.int64))

    def from_wire(self, tensor: torch.Tensor) -> np.ndarray:
        return tensor.numpy().view(self.dtype)


@functools.lru_cache(maxsize=4)
def _zeros(nbytes: int) -> bytes:
    return bytes(nbytes)


@functools.lru_cache(maxsize=4096)
def _public_key(raw: bytes) -> Any:
    """A parsed X25519 public key (public data: a simulation's clients parse each one once)."""
    return _crypto().PublicKey.from_public_bytes(raw)


@functools.lru_cache(maxsize=8)
def ring(seed: int, rnd: int, cohort: tuple[int, ...], neighbours: int | None) -> dict[int, tuple[int, ...]]:
    """Each client's masking neighbours, public: all others (SecAgg), or ``neighbours`` of them
    on a ring over a permutation of the cohort seeded by the run seed and the round (SecAgg+)."""
    n = len(cohort)
    half = n if neighbours is None else math.ceil(neighbours / 2)
    if 2 * half >= n - 1:
        return {u: tuple(v for v in cohort if v != u) for u in cohort}
    order = [cohort[i] for i in numpy_rng(seed, "secagg", "graph", rnd).permutation(n)]
    return {u: tuple(sorted(order[(i + d) % n] for d in range(-half, half + 1) if d)) for i, u in enumerate(order)}


def threshold_of(fraction: float, neighbours: int) -> int:
    """t of a neighbourhood of ``neighbours`` others and the client itself."""
    return math.ceil(fraction * (neighbours + 1))


@dataclass(frozen=True)
class Quantizer:
    """Clipping to [−R, R] and stochastic rounding to integers in [0, levels].

    An entry maps to t = (x + R) · levels / 2R. It is rounded to the nearest multiple of
    2^−f (f = ``fraction_bits``: 8 where the real type and the field have room, so within
    2^−9 of a step), then up with probability its fractional part, by adding f uniform
    bits and shifting them out: E[q] = t within 2^−9 of a step. In place, no per-entry
    Python.
    """

    clip: float
    levels: int
    real: Any  # np.float32 or np.float64
    fraction_bits: int

    @classmethod
    def of(cls, clip: float, levels: int, width: int) -> Quantizer:
        used = levels.bit_length()
        real = np.float32 if used + 8 <= 24 else np.float64
        mantissa = 24 if real is np.float32 else 53
        return cls(clip, levels, real, max(0, min(8, mantissa - used, width - used)))

    def inside(self, low: float, high: float) -> bool:
        """Whether entries within [low, high] need no clipping: inside [−R, R] by a margin of
        two fine steps (2^−f of a level), more than the real type's rounding can add."""
        margin = 2 * (2 * self.clip) / (self.levels * (1 << self.fraction_bits))
        return bool(low >= -self.clip + margin and high <= self.clip - margin)

    def __call__(
        self, x: np.ndarray, noise: np.ndarray, work: np.ndarray, spare: np.ndarray, out: np.ndarray, inside: bool = False
    ) -> None:
        """``out`` = the quantized ``x``. ``noise``: one uniform byte per entry, read first;
        ``work`` (real, may be ``x``) and ``spare`` (of ``out``'s type, may overlap ``noise``): scratch.
        ``inside``: :meth:`inside` holds for ``x``'s range, so the clipping pass is skipped."""
        f = self.fraction_bits
        np.copyto(out, noise if f == 8 else noise >> (8 - f), casting="unsafe")  # f random bits
        scale = self.levels / (2 * self.clip) * (1 << f)
        np.multiply(x, self.real(scale), out=work)
        work += self.real(self.clip * scale + 0.5)  # + 0.5: to the nearest multiple of 2^-f
        if not inside:
            np.clip(work, 0.5, self.levels * (1 << f) + 0.5, out=work)
        np.copyto(spare, work, casting="unsafe")  # truncation: the floor, as work > 0
        out += spare
        np.right_shift(out, out.dtype.type(f), out=out)


def _u8(rows: list[bytes], width: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(b"".join(rows)), dtype=torch.uint8).reshape(len(rows), width)


def _ids(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _tensor(control: Control, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """``control``'s tensor ``name`` as an array, checked: a ValueError names what is wrong."""
    t = control.tensors.get(name)
    if t is None or t.dtype != dtype or tuple(t.shape) != shape:
        got = "nothing" if t is None else f"{t.dtype} {tuple(t.shape)}"
        raise ValueError(f"secagg {control.step}: expected {name} of {dtype} {shape}, got {got}")
    return t.numpy()


def _id_list(control: Control, name: str, allowed: tuple[int, ...] | list[int] | None = None) -> list[int]:
    """``control``'s tensor ``name``: a sorted list of distinct client ids (each in ``allowed``, if given)."""
    t = control.tensors.get(name)
    if t is None or t.dtype != torch.int32 or t.dim() != 1:
        raise ValueError(f"secagg {control.step}: expected {name} as a 1-d int32 tensor")
    ids = t.tolist()
    if ids != sorted(set(ids)) or (allowed is not None and not set(ids) <= set(allowed)):
        raise ValueError(f"secagg {control.step}: {name} is not a sorted list of distinct expected client ids")
    return ids


class ClientRound:
    """One client's secrets for one round, in its private state (its own process); each is
    dropped as soon as the protocol no longer needs it."""

    def __init__(self, rnd: int):
        self.round = rnd
        self.step = ADVERTISE
        self.key: Any = _crypto().PrivateKey.generate()  # k_u
        self.public = self.key.public_key().public_bytes_raw()  # K_u
        self.self_seed: bytes | None = os.urandom(SECRET_BYTES)  # b_u
        self.record_key: bytes | None = os.urandom(SECRET_BYTES)  # r_u: opens the seed record; rebuilt if it drops
        self.neighbours: tuple[int, ...] = ()
        self.threshold = 0
        self.channels: dict[int, bytes] = {}  # neighbour -> c_uv
        self.seeds: dict[int, bytes] = {}  # neighbour -> s_uv
        self.shares: dict[int, np.ndarray] = {}  # owner -> this client's shares (2, limbs) of (r_owner, b_owner)
        self.masking: list[int] = []  # neighbours that completed the set-up


@dataclass
class ServerRound:
    """The server's view of a round's set-up: public keys, sealed seed records, who did what."""

    round: int
    neighbours: dict[int, tuple[int, ...]]
    threshold: dict[int, int]
    records: dict[int, bytes]  # who completed step 1 (its neighbours mask with it), in id order ->
    # its mask seeds sealed under r_u (opened only if it drops)
    ready: list[int]  # received its neighbours' shares: may send a masked update


class SecAgg:
    """Secure aggregation, SecAgg+ style: pairwise and self masks, Shamir recovery of drop-outs."""

    name = "secagg"
    Params = SecAggParams
    accepts = frozenset(UpdateKind)
    combines_encoded = True
    stage = "secure"
    points = ("client_send",)

    def __init__(self, hp: SecAggParams):
        self.hp = hp
        self.field = Field(hp.bits)
        self.levels = (1 << (hp.bits - math.ceil(math.log2(hp.max_examples)))) - 1
        self.quantize = Quantizer.of(hp.clip_range, self.levels, self.field.width)
        self.seed = 0
        self.round: ServerRound | None = None

    def bind(self, config: Any) -> None:
        self.seed = config.seed

    def graph(self, rnd: int, cohort: list[int]) -> dict[int, tuple[int, ...]]:
        return ring(self.seed, rnd, tuple(sorted(cohort)), self.hp.neighbours)

    # ------------------------------------------------------------------ server half

    def setup(self, rnd: int, cohort: list[int], exchange: ControlExchange) -> list[int]:
        """Steps 0 and 1 and the forwarding of the shares; the clients that may train and mask."""
        probe = _crypto().PrivateKey.generate()

        def read_key(u: int, a: Control) -> bytes:
            raw = bytes(_tensor(a, "key", torch.uint8, (1, KEY_BYTES)))
            try:  # a low-order point would break every agreement with it: refused here, once
                probe.exchange(_public_key(raw))
            except ValueError:
                raise ValueError("its public key is not a valid X25519 point") from None
            return raw

        public = self._answers(rnd, exchange({u: Control(self.name, ADVERTISE) for u in sorted(set(cohort))}), read_key)
        members = sorted(public)
        if len(members) < 2:
            raise RoundError(f"secagg: {len(members)} client(s) advertised keys; secure aggregation needs 2")
        graph = self.graph(rnd, members)
        asks = {
            u: Control(self.name, SHARE, {"cohort": _ids(members), "keys": _u8([public[v] for v in graph[u]], KEY_BYTES)})
            for u in members
        }

        def read_shares(u: int, a: Control) -> tuple[bytes, torch.Tensor]:
            shares = _tensor(a, "shares", torch.uint8, (len(graph[u]), SEALED_SHARES))
            return bytes(_tensor(a, "record", torch.uint8, (1, len(graph[u]) * SECRET_BYTES + 16))), torch.from_numpy(shares)

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
                "senders": _ids([u for u, _ in senders]), "shares": torch.stack([row for _, row in senders])
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
        answers = exchange({v: Control(self.name, UNMASK, {"survivors": _ids(asked[v])}) for v in survivors})
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
                    record = _open(record_key, _nonce(d), setup.records[d], _aad("seeds", ctx.round, d, d), f"client {d}'s seed record")
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
                seed_rows = _tensor(reply, "seed", torch.int32, (len(owners), SECRET_LIMBS))
                key_rows = _tensor(reply, "key", torch.int32, (len(gone[v]), SECRET_LIMBS))
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

    # ------------------------------------------------------------------ client half

    def answer(self, control: Control, ctx: PluginContext) -> Control:
        """The client's side of steps 0, 1, forward and 3, with its secrets in ``ctx.state``."""
        if ctx.state is None:
            raise ValueError("secagg's client half needs the client's private state (ctx.state)")
        if control.step == ADVERTISE:
            mine = ClientRound(ctx.round)
            ctx.state[self.name] = mine
            return Control(self.name, ADVERTISE, {"key": _u8([mine.public], KEY_BYTES)})
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
        c = _crypto()
        members = _id_list(control, "cohort")
        if u not in members:
            raise ValueError(f"secagg share: client {u} is not in the cohort it was sent")
        neighbours = self.graph(mine.round, members)[u]  # the client derives its neighbourhood itself
        rows = [bytes(row) for row in _tensor(control, "keys", torch.uint8, (len(neighbours), KEY_BYTES))]
        if len({*rows, mine.public}) != len(rows) + 1:
            raise ValueError("secagg share: the neighbours' public keys are not distinct")
        for v, row in zip(neighbours, rows):
            (pair,) = hkdf(mine.key.exchange(_public_key(row)), pair_info(mine.round, u, v))
            mine.channels[v], mine.seeds[v] = pair[:SECRET_BYTES], pair[SECRET_BYTES:]
        mine.key = None  # the channel keys and seeds are all this client needs of it
        mine.neighbours = neighbours
        mine.threshold = threshold_of(self.hp.threshold, len(neighbours))
        assert mine.record_key is not None and mine.self_seed is not None
        record = c.AESGCM(mine.record_key).encrypt(
            _nonce(u), b"".join(mine.seeds[v] for v in neighbours), _aad("seeds", mine.round, u, u)
        )
        points = sorted((u, *neighbours))
        shares = shamir.split(shamir.to_limbs([mine.record_key, mine.self_seed]), mine.threshold, [h + 1 for h in points])
        index = {h: i for i, h in enumerate(points)}
        mine.shares[u] = shares[index[u]]
        sealed = [
            c.AESGCM(mine.channels[v]).encrypt(_nonce(u), shares[index[v]].astype("<u4").tobytes(), _aad("share", mine.round, u, v))
            for v in neighbours
        ]
        mine.record_key = None  # sealed its seeds; its own share of r_u is all it keeps
        mine.step = SHARE
        return Control(self.name, SHARE, {
            "record": _u8([record], len(record)),
            "shares": _u8(sealed, SEALED_SHARES),
        })

    def _receive(self, control: Control, mine: ClientRound, u: int) -> Control:
        senders = _id_list(control, "senders", mine.neighbours)
        if len(senders) + 1 < mine.threshold:
            raise ValueError(
                f"secagg forward: only {len(senders)} neighbours completed the set-up, fewer than the "
                f"threshold {mine.threshold} of this client's neighbourhood"
            )
        sealed = _tensor(control, "shares", torch.uint8, (len(senders), SEALED_SHARES))
        for v, row in zip(senders, sealed):
            plain = _open(mine.channels[v], _nonce(v), bytes(row), _aad("share", mine.round, v, u), f"the share from client {v}")
            mine.shares[v] = np.frombuffer(plain, dtype="<u4").reshape(2, SECRET_LIMBS).astype(np.int64)
        mine.masking = senders
        mine.seeds = {v: mine.seeds[v] for v in senders}
        mine.channels = {}
        mine.step = FORWARD
        return Control(self.name, FORWARD)

    def _reveal(self, control: Control, mine: ClientRound, u: int) -> Control:
        survivors = _id_list(control, "survivors", mine.masking)
        if len(survivors) + 1 < mine.threshold:
            raise ValueError(
                f"secagg unmask: only {len(survivors)} neighbours survived, fewer than the threshold "
                f"{mine.threshold} of this client's neighbourhood; no share is revealed"
            )
        gone = [w for w in mine.masking if w not in survivors]
        seed = np.stack([mine.shares[w][1] for w in sorted([u, *survivors])]).astype(np.int32)
        key = np.stack([mine.shares[w][0] for w in gone]).astype(np.int32) if gone else np.zeros((0, SECRET_LIMBS), np.int32)
        return Control(self.name, UNMASK, {"seed": torch.from_numpy(seed), "key": torch.from_numpy(key)})

    def encode(self, payload: Update, ctx: PluginContext) -> Update:
        """Step 2: quantize the update, add the self mask and the pairwise masks."""
        mine = self._client_round(ctx, FORWARD)
        u = ctx.client_id
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
