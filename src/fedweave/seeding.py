"""Seeds derived from the run seed and a purpose, so every random choice is reproducible.

Each draw gets its own stream, keyed by what it is for (``"sample", round``,
``"client", round, client_id``, ...). No stream depends on how many numbers another
consumed, so a resumed run draws exactly what an uninterrupted one would.
"""

from __future__ import annotations

import functools
import threading
import zlib
from collections.abc import Sequence

import numpy as np
import torch


TORCH_GLOBAL = threading.RLock()
"""Held by whoever seeds torch's global generator and draws from it (a model's initial weights,
which ``nn.Module`` constructors draw from that generator alone), or draws from it unseeded (any
model built): the generator is one per process, so two threads that build models at once (a
server and client nodes run as threads of one process, as the tests run them) would otherwise
draw from each other's seeded stream, and the server's initial global model would depend on
the threads' timing."""

_CRC: dict[str, int] = {}  # a purpose's CRC-32, by name (a handful of names, each asked per client per round)


def _key(part: int | str) -> int:
    if isinstance(part, int):
        return part
    crc = _CRC.get(part)
    if crc is None:
        crc = _CRC[part] = zlib.crc32(part.encode())
    return crc


def derive_seed(seed: int, *keys: int | str) -> int:
    """A 63-bit seed for the stream named by ``keys`` under run seed ``seed``: the first
    64 bits of ``np.random.SeedSequence([seed, *keys]).generate_state(1, np.uint64)``
    (strings as their CRC-32), computed as :func:`_seed_sequence` does."""
    return _seed_sequence(_words_of([seed, *map(_key, keys)])) & _SEED_MASK


def derive_seeds(seed: int, keys: Sequence[int | str], lasts: Sequence[int | str]) -> list[int]:
    """``[derive_seed(seed, *keys, last) for last in lasts]``, the words of the common keys
    read once (the streams of one update's tensors: a seed per tensor of every update; a client's
    per client of a cohort). Many one-word ``lasts`` are mixed together on arrays (:func:`_seed_sequences`)."""
    head = _words_of([seed, *(_key(k) for k in keys)])
    words = [_key(last) for last in lasts]
    if len(words) >= _MANY and all(0 <= w <= _MASK for w in words):
        return _seed_sequences(head, words)
    return [_seed_sequence(head + _words_of([w])) & _SEED_MASK for w in words]


# NumPy's SeedSequence (numpy/random/bit_generator.pyx; O'Neill's seed_seq_fe) with a pool of
# four 32-bit words, in Python integers. Constructing the NumPy object costs ~15 us, paid
# per tensor by every codec that draws. The pool after all but the last word (the run seed,
# a purpose, a round, a client...) is shared by many streams (the tensors of one update),
# so it is kept.
_MASK = 0xFFFFFFFF
_SEED_MASK = (1 << 63) - 1
_INIT_A, _MULT_A, _INIT_B, _MULT_B = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
_MIX_L, _MIX_R = 0xCA01F9DD, 0x4973F715
_POOL = 4


def _words(value: int) -> list[int]:
    """``value`` as SeedSequence reads an int: 32-bit words, least significant first."""
    if value < 0:
        raise ValueError(f"seed keys must be non-negative, got {value}")
    words = [value & _MASK]
    value >>= 32
    while value:
        words.append(value & _MASK)
        value >>= 32
    return words


# The hash constant does not depend on the entropy: step k of the pool's mixing xors with
# _HASH_A[k] and multiplies by _HASH_A[k + 1], whatever the words (computed once, not per seed).
_HASH_A = [_INIT_A]
_HASH_A_GROWING = threading.Lock()  # codecs draw seeds from several threads; entries, once there, never change


def _hash_a(steps: int) -> list[int]:
    """The hash constants of the first ``steps`` + 1 mixing steps."""
    if len(_HASH_A) <= steps:
        with _HASH_A_GROWING:
            while len(_HASH_A) <= steps:
                _HASH_A.append((_HASH_A[-1] * _MULT_A) & _MASK)
    return _HASH_A


_hash_a(_POOL * _POOL + 16 * _POOL)  # enough for 20 entropy words
_FILL = [(_HASH_A[i], _HASH_A[i + 1]) for i in range(_POOL)]
_CROSS = [
    (src, dst, _HASH_A[_POOL + k], _HASH_A[_POOL + k + 1])
    for k, (src, dst) in enumerate((s, d) for s in range(_POOL) for d in range(_POOL) if s != d)
]


def _absorb(pool: list[int], step: int, word: int) -> int:
    """Mix one more entropy word into every word of ``pool`` (in place), from mixing step
    ``step`` on; the next step."""
    consts = _hash_a(step + _POOL)
    for dst in range(_POOL):  # the mix of two words, inlined
        value = ((word ^ consts[step + dst]) * consts[step + dst + 1]) & _MASK
        mixed = (_MIX_L * pool[dst] - _MIX_R * (value ^ (value >> 16))) & _MASK
        pool[dst] = mixed ^ (mixed >> 16)
    return step + _POOL


@functools.lru_cache(maxsize=1024)
def _pool(words: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
    """The pool after the entropy words ``words``, and the next mixing step."""
    if len(words) > _POOL:
        head, step = _pool(words[:-1])
        pool = list(head)
        step = _absorb(pool, step, words[-1])
        return tuple(pool), step
    return tuple(_first_pool(words)), _POOL * _POOL


def _first_pool(words: tuple[int, ...]) -> list[int]:
    """The pool after at most :data:`_POOL` entropy words (no cache: such a stream, a client's of a
    round, is rarely asked twice, and a cache's miss costs more than the mixing)."""
    pool = []
    for i, (pre, post) in enumerate(_FILL):
        value = (((words[i] if i < len(words) else 0) ^ pre) * post) & _MASK
        pool.append(value ^ (value >> 16))
    for src, dst, pre, post in _CROSS:  # the mix of two words, inlined: this loop is most of a seed's cost
        value = ((pool[src] ^ pre) * post) & _MASK
        mixed = (_MIX_L * pool[dst] - _MIX_R * (value ^ (value >> 16))) & _MASK
        pool[dst] = mixed ^ (mixed >> 16)
    return pool


def _words_of(entropy: Sequence[int]) -> tuple[int, ...]:
    """The 32-bit words SeedSequence reads from ``entropy``, in order."""
    if all(0 <= value <= _MASK for value in entropy):  # most are one word each (a seed per client per round)
        return tuple(entropy)
    words: tuple[int, ...] = ()
    for value in entropy:
        words += (value,) if 0 <= value <= _MASK else tuple(_words(value))
    return words


def _seed_sequence(words: tuple[int, ...]) -> int:
    """``int(np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0])`` of the
    ``entropy`` of these words (:func:`_words_of`)."""
    if len(words) > _POOL:  # the last word (a tensor's name, ...) is the one streams differ by
        head, step = _pool(words[:-1])
        pool = list(head)
        _absorb(pool, step, words[-1])
    else:
        pool = _first_pool(words)
    hash_const = _INIT_B
    out = 0
    for i in range(2):  # two 32-bit words, little-endian
        value = pool[i] ^ hash_const
        hash_const = (hash_const * _MULT_B) & _MASK
        value = (value * hash_const) & _MASK
        out |= (value ^ (value >> 16)) << (32 * i)
    return out


_MANY = 8  # from this many streams on, mixing them on arrays beats one after another (~1 us against ~10 us each)


def _seed_sequences(head: tuple[int, ...], lasts: Sequence[int]) -> list[int]:
    """``[_seed_sequence(head + (last,)) & _SEED_MASK for last in lasts]`` for one-word ``lasts``:
    :func:`_seed_sequence` itself, its last word a uint64 array of them. Its mixing reads the same
    on arrays (NumPy 2 takes the Python int constants as uint64; words are 32-bit, so a product
    of two fits, and a difference wraps modulo 2^64, the same modulo 2^32)."""
    return (_seed_sequence((*head, np.asarray(lasts, dtype=np.uint64))) & _SEED_MASK).tolist()  # type: ignore[arg-type, attr-defined]


def torch_generators(seed: int, keys: Sequence[int | str], lasts: Sequence[int | str]) -> list[torch.Generator]:
    """``[torch_generator(seed, *keys, last) for last in lasts]``, the seeds derived together
    (:func:`derive_seeds`): a generator per client of a cohort."""
    return [torch.Generator().manual_seed(s) for s in derive_seeds(seed, keys, lasts)]


def numpy_rng(seed: int, *keys: int | str) -> np.random.Generator:
    return np.random.default_rng(derive_seed(seed, *keys))


def torch_generator(seed: int, *keys: int | str) -> torch.Generator:
    return torch.Generator().manual_seed(derive_seed(seed, *keys))
