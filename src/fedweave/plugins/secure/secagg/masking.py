"""SecAgg's field, the integers mod 2^bits, and its masks: PRG(seed) added or subtracted in place."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from fedweave.plugins.secure.secagg.keys import crypto


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
        c = crypto()
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
