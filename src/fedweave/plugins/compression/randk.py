"""Random-k sparsification: send k entries of each tensor chosen at random.

Stich, Cordonnier & Jaggi, "Sparsified SGD with Memory", NeurIPS 2018
(https://arxiv.org/abs/1809.07599); Konečný et al., "Federated Learning: Strategies for
Improving Communication Efficiency", 2016 (https://arxiv.org/abs/1610.05492).

The positions are drawn from a seeded generator, so only its seed travels
(``name.__seed``, 8 bytes) with the values (``name.__values``). Without error feedback
the values are scaled by d/k, which makes the estimate unbiased: E[decode(encode(x))] = x.
Error feedback needs a contraction, so with it the values are sent unscaled
(Stich et al. 2018). With ``shared_indices`` every client of a round draws the same
positions, so encoded updates line up and can be summed while encoded (secure
aggregation; not HE, which adds each update into the encrypted model itself); otherwise each client draws its own (lower variance of the average).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from fedweave.plugins.contracts import Payload, PluginContext
from fedweave.plugins.compression.wire import COMPRESSOR, Compressor, Site, require, vectors
from fedweave.plugins.packing import SEP
from fedweave.schema import opt
from fedweave.types import Update


@dataclass
class RandKHParams:
    ratio: float = opt(0.1, gt=0, le=1, help="share of each tensor's entries sent (at least one)")
    error_feedback: bool = opt(False, help="keep what was not sent and add it next time (values then unscaled)")
    shared_indices: bool = opt(False, help="every client of a round sends the same positions (summable)")


HELD_POSITIONS = 1 << 22
"""At most this many drawn positions are kept for reuse (16 MB as int32)."""


class RandKCodec:
    def __init__(self, hp: RandKHParams):
        self.hp = hp
        self.drawn: dict[tuple[int, int], torch.Tensor] = {}  # (seed, numel) -> positions
        self.held = 0  # positions in ``drawn``

    def compress(self, x: torch.Tensor, site: Site) -> dict[str, torch.Tensor]:
        return self._select(x.reshape(-1), site)[0]

    def compress_keeping_rest(self, xs: list[torch.Tensor], sites: list[Site]) -> list[dict[str, torch.Tensor]]:
        """The fields of each x, and x (the caller's, contiguous) left holding what they do not
        carry: at the drawn positions x less the sent value (zero there with error feedback,
        which sends values unscaled), elsewhere x as it was."""
        out = []
        for x, site in zip(xs, sites):
            flat = x.view(-1)
            fields, positions = self._select(flat, site)
            flat.index_add_(0, positions, fields["values"], alpha=-1)  # x + -1 * v is x - v, bit for bit
            out.append(fields)
        return out

    def _select(self, flat: torch.Tensor, site: Site) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The fields of the vector ``flat`` and the positions they carry."""
        seed = self.seed(site)
        indices = self._positions(seed, flat.numel())
        scale = 1.0 if self.hp.error_feedback else flat.numel() / indices.numel()
        values = flat.index_select(0, indices)
        fields = {"values": values if self.hp.error_feedback else values.mul_(scale), "seed": torch.tensor([seed], dtype=torch.int64)}
        return fields, indices

    def seed(self, site: Site) -> int:
        """The seed of the positions of ``site``'s tensor: the round's for every client with
        ``shared_indices``, else the client's own."""
        return site.seed_for(site.name) if self.hp.shared_indices else site.seed_for(site.client_id, site.name)

    def field_dtypes(self) -> dict[str, torch.dtype]:
        return {"values": torch.float32, "seed": torch.int64}

    def k(self, numel: int) -> int:
        """How many entries of a tensor of ``numel`` entries are sent."""
        return max(1, int(self.hp.ratio * numel))

    def check_fields(self, fields: dict[str, torch.Tensor], shape: tuple[int, ...]) -> None:
        vectors(fields)
        require(fields, {"values": self.k(math.prod(shape)), "seed": 1})

    def decompress(self, fields: dict[str, torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        numel = math.prod(shape)
        positions = self._positions(int(fields["seed"].item()), numel).long()
        values = fields["values"].to(torch.float32).reshape(-1)
        return torch.zeros(numel, dtype=torch.float32).scatter_(0, positions, values).reshape(shape)

    def _positions(self, seed: int, numel: int) -> torch.Tensor:
        """The first k of a seeded permutation. Drawing them is most of the codec's work, and
        in one process the same positions are needed again (the server's decode in
        simulation): the latest draws are kept, oldest dropped first."""
        key = (seed, numel)
        if key in self.drawn:
            return self.drawn[key]
        k = self.k(numel)
        dtype = torch.int32 if numel <= torch.iinfo(torch.int32).max else torch.int64
        positions = randperm_head(seed, numel, k, dtype)
        while self.drawn and self.held + k > HELD_POSITIONS:
            self.held -= self.drawn.pop(next(iter(self.drawn))).numel()
        if k <= HELD_POSITIONS:
            self.drawn[key] = positions
            self.held += k
        return positions


RANDPERM_32BIT = (1 << 32) // 20
"""``torch.randperm`` draws one 32-bit number per step for fewer entries than this, 64-bit ones from it."""

HEAD_FROM = 1 << 15
"""The head of a permutation of at least this many entries, and at most an eighth of them, is
drawn by :func:`fisher_yates_head`; the whole permutation is cheaper to draw otherwise (as
measured between two clients' training, with cold caches: warm, the head wins from 2**13)."""

_streams = threading.local()  # per thread: an MT19937 re-seeded for each draw (making one costs ~70 us)


def randperm_head(seed: int, n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """``torch.randperm(n, generator=torch.Generator().manual_seed(seed), dtype=dtype)[:k]``
    (a tensor of its own), by :func:`fisher_yates_head` where that is cheaper: it costs
    O(k log k) where the whole permutation costs O(n); for k = n / 10 of 100,352 entries, a
    third of randperm's time with warm caches, 0.6 of it between two clients' training."""
    if HEAD_FROM <= n < RANDPERM_32BIT and 1 <= 8 * k <= n and -(1 << 63) <= seed < 1 << 64:
        return torch.from_numpy(fisher_yates_head(seed, n, k)).to(dtype)
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed), dtype=dtype)[:k].clone()


def fisher_yates_head(seed: int, n: int, k: int) -> np.ndarray:
    """The first ``k`` entries (int32) of torch's CPU ``randperm(n)`` drawn with a generator
    seeded with ``seed``, for 1 <= k <= n < :data:`RANDPERM_32BIT`, in O(k log k).

    torch shuffles ``a = [0, 1, ..., n - 1]`` forward (aten ``randperm_cpu``): step
    i = 0 .. n - 2 swaps a[i] with a[j_i], j_i = i + r_i % (n - i), where r_i is the
    generator's next raw 32-bit MT19937 output. No step touches a position below its own,
    so a[i] is final after step i and the head depends on the first k outputs only (a step
    n - 1 would swap a[n - 1] with itself: counting it changes nothing). torch seeds its
    MT19937 with ``init_genrand(seed mod 2**32)``, as ``RandomState.seed`` seeds NumPy's,
    whose ``random_raw`` then hands out the same r_i.

    Which value step i moves into a[i], without the n-entry array: the one at j_i just before
    step i. A position v >= i is touched by an earlier step t only when t aims at it (t's own
    position is below i): it holds v until a step aims at it; after step t aims at it
    (j_t = v), it holds what step t read at a[t], call it d(t), until the next step aiming at
    it. So

    - out[i] = j_i, unless an earlier step aimed at j_i: then d(t) for the last such t;
    - d(t) = t, unless an earlier step aimed at t: then d(p) for the last such p < t.

    "The last earlier step aiming at the same position" is a step's predecessor once the
    steps are sorted by (target, step); following p from t to a step no earlier step aimed
    at gives d(t), and each hop goes to an earlier step, so the walk ends. Some earlier
    step aimed at position t < k with probability about t / n, so for k <= n / 8 a walk
    goes on at each hop with probability under 1/8: the walks are short, the sort is the cost.
    """
    bits = getattr(_streams, "bits", None)
    if bits is None:
        bits = _streams.bits = np.random.MT19937()
        _streams.seeder = np.random.RandomState(bits)
    _streams.seeder.seed(seed & 0xFFFFFFFF)
    raw = bits.random_raw(k).astype(np.uint32)
    steps = np.arange(k, dtype=np.uint32)
    target = raw % (n - steps)
    target += steps
    shift = (k - 1).bit_length()  # (target, step) sorts as target << shift | step, below n << shift
    kind = np.uint32 if n << shift < 1 << 32 else np.uint64
    keys = target.astype(kind) << kind(shift)
    keys |= steps
    keys.sort()
    aim = keys >> kind(shift)
    repeat = (aim[1:] == aim[:-1]).nonzero()[0]
    out = target.view(np.int32)
    if repeat.size == 0:
        return out
    mask = kind((1 << shift) - 1)
    later, earlier = keys[repeat + 1] & mask, keys[repeat] & mask  # earlier: the last step before later aiming there
    inside = keys[: keys.searchsorted(kind(k << shift))]  # the steps aiming below k, where steps read
    aim, step = inside >> kind(shift), inside & mask
    aimed = step < aim
    aim, step = aim[aimed], step[aimed]
    previous = np.arange(k, dtype=kind)  # previous[t]: the last step before t aiming at t (t if none)
    if aim.size:
        last = (aim[1:] != aim[:-1]).nonzero()[0]
        previous[aim[last]] = step[last]
        previous[aim[-1]] = step[-1]
    while True:
        back = previous[earlier]
        if (back == earlier).all():
            break
        earlier = back
    out[later] = earlier
    return out


def _summable(params: Any) -> bool:
    return bool(params.shared_indices)


class RandK(Compressor):
    """Random-k sparsification, unbiased (scaled by d/k) or with error feedback."""

    name = "randk"
    HParams = RandKHParams
    declares = replace(COMPRESSOR, summable=_summable)

    def __init__(self, hp: RandKHParams):
        self.randk = RandKCodec(hp)
        super().__init__(self.randk, hp.error_feedback)
        self.hp = hp

    def decode(self, payload: Payload, ctx: PluginContext) -> Payload:
        """With ``shared_indices`` an update is decoded at the round's positions, whatever seed it
        carries: secure aggregation combines the clients' seeds by their maximum, so one client's
        larger seed would otherwise place every client's values."""
        if self.hp.shared_indices and isinstance(payload, Update):
            seeds = {k: self._site("up", ctx, k[: -len(SEP + "seed")]) for k in payload.tensors if k.endswith(SEP + "seed")}
            own = {k: torch.tensor([self.randk.seed(site)], dtype=torch.int64) for k, site in seeds.items()}
            payload = replace(payload, tensors={**payload.tensors, **own})
        return super().decode(payload, ctx)
