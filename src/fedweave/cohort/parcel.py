"""What the main process and its simulation workers (:mod:`fedweave.cohort.workers`) hand each
other, pickled: each CPU storage once for each dtype that views it, and every tensor on it a view
of it (a storage viewed as two dtypes and sent by value comes back as two copies, which no longer
share their memory).

A storage of fewer than :data:`SHARE_BYTES` travels by value, in the pickle; a larger one
through shared memory (torch's own reduction, ``torch.multiprocessing``, which moves it there).
torch's reduction alone, for every tensor, costs ~14 microseconds to pickle and ~8 to unpickle
each (a storage object and cache entry per tensor, a tensor rebuilt of its own), and each storage
new to shared memory a file, page faults and a handshake with the sender for its descriptor: ~29
ms a round with two workers for 100 digits MLP clients, whose updates are rows of four stacked
tensors (:mod:`fedweave.cohort.vectorised`); ~16 ms so. On the other side a group's updates are
rows of one tensor again, whose finiteness is read at once (:func:`fedweave.stacked.finite_rows`).
A lazily negated or conjugated view is sent as its values (torch's reduction drops those bits:
its values would come back negated or conjugated); a tensor that is not a plain strided CPU tensor
(a Parameter or subclass, one that requires grad, a CUDA, sparse, nested or quantized one, an empty
one) goes torch's way.

Only the run's own processes write what :func:`unpack` reads (one trust domain, as the queues'
own pickles are): nothing another party sent is ever unpickled.
"""

from __future__ import annotations

import io
import pickle
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401  (registers torch's shared-memory reductions with ForkingPickler)

SHARE_BYTES = 2**20
"""Storages of at least this many bytes go through shared memory, smaller ones by value (two
processes on a 2-core VM, a fresh storage there and back: by value 1.1 ms for 256 KB and 3.0 for
1 MB, through shared memory 3.6 and 2.4, at 4 MB 12.8 against 6.6)."""


def _view(base: torch.Tensor, size: tuple[int, ...], stride: tuple[int, ...], offset: int) -> torch.Tensor:
    return base.as_strided(size, stride, offset)


def _flat(data: bytearray, dtype: torch.dtype) -> torch.Tensor:
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype)


class _Pickler(ForkingPickler):
    """ForkingPickler that reduces a plain CPU tensor to a view of a flat tensor over its whole
    storage, one flat tensor per storage and dtype (pickle's memo writes it once)."""

    def __init__(self, file: io.BytesIO):
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self._flats: dict[tuple[int, torch.dtype], torch.Tensor] = {}  # by storage (which its flat keeps alive)
        self._flat_ids: set[int] = set()

    def reducer_override(self, obj: Any) -> Any:
        if id(obj) in self._flat_ids:  # a storage: by value, or torch's way into shared memory
            if obj.untyped_storage().nbytes() >= SHARE_BYTES:
                return NotImplemented
            return _flat, (pickle.PickleBuffer(obj.view(torch.uint8).numpy()), obj.dtype)
        if type(obj) is not torch.Tensor or not _plain(obj):
            return NotImplemented
        if obj.is_neg() or obj.is_conj():
            obj = obj.resolve_conj().resolve_neg()
        storage = obj.untyped_storage()
        key = (_identity(storage), obj.dtype)
        flat = self._flats.get(key)
        if flat is None:
            flat = torch.empty(0, dtype=obj.dtype).set_(storage, 0, (storage.nbytes() // obj.element_size(),), (1,))
            self._flats[key] = flat
            self._flat_ids.add(id(flat))
        return _view, (flat, tuple(obj.shape), obj.stride(), obj.storage_offset())


def _identity(storage: torch.UntypedStorage) -> int:
    """``storage`` itself (its C++ object), not its memory's address: moved into shared memory, a
    storage keeps its identity and frees its old memory, which a storage made later in the same
    pickle (a resolved view's values) may then be given; and two storages may start at one address
    (two tensors ``torch.from_numpy`` of one array and of a part of it)."""
    return storage._cdata


def _plain(tensor: torch.Tensor) -> bool:
    if (tensor.device.type != "cpu" or tensor.layout is not torch.strided or tensor.is_nested
            or tensor.requires_grad or tensor.is_quantized):
        return False
    nbytes = tensor.untyped_storage().nbytes()
    return nbytes > 0 and nbytes % tensor.element_size() == 0


def pack(obj: Any) -> bytes:
    """``obj`` pickled for another of the run's processes."""
    buffer = io.BytesIO()
    _Pickler(buffer).dump(obj)
    return buffer.getvalue()


def unpack(data: bytes) -> Any:
    """What :func:`pack` packed in another of the run's processes."""
    return pickle.loads(data)
