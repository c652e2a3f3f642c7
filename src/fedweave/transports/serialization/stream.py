"""Decoding one message from consecutive chunks of any sizes."""

from __future__ import annotations

import torch

from fedweave.errors import PayloadTooLarge, SerializationError
from fedweave.transports.serialization.decode import (
    Layout,
    build_message,
    bytes_of,
    empty_tensor,
    read_header,
    read_layout,
    receive_region,
    region_view,
)
from fedweave.transports.serialization.format import HEADER, Expected, align
from fedweave.types import Message


class StreamDecoder:
    """Decodes one message from consecutive chunks of any sizes.

    The header and metadata are checked as soon as they are complete, before any
    tensor is allocated (so an oversized or unexpected message costs nothing); then
    every tensor is allocated once and each chunk is copied straight into it.
    :meth:`finish` returns the message, or raises if it is incomplete.
    """

    def __init__(self, *, max_bytes: int | None = None, expected: Expected | None = None):
        self.max_bytes = max_bytes
        self.expected = expected
        self.received = 0
        self._head = bytearray()
        self._head_len: int | None = None  # header + metadata + padding, once known
        self._layout: Layout | None = None
        self._targets: list[tuple[int, int, memoryview]] = []  # absolute start, end, destination
        self._values: dict[tuple[str, str], torch.Tensor] = {}
        self._next = 0  # index into _targets

    @property
    def total(self) -> int | None:
        """The message's declared size, once its header has arrived."""
        return None if self._layout is None else self._layout.total

    @property
    def complete(self) -> bool:
        return self._layout is not None and self.received == self._layout.total

    def feed(self, chunk: bytes | bytearray | memoryview) -> None:
        mv = memoryview(chunk)
        if mv.ndim != 1 or mv.itemsize != 1:
            mv = mv.cast("B")
        while len(mv):
            if self._layout is None:
                mv = self._feed_head(mv)
                continue
            if self.received + len(mv) > self._layout.total:
                raise SerializationError(
                    f"malformed message: more bytes than the {self._layout.total} its header declares"
                )
            self._feed_data(mv)
            self.received += len(mv)
            return

    def _feed_head(self, mv: memoryview) -> memoryview:
        need = HEADER.size if self._head_len is None else self._head_len
        take = min(need - len(self._head), len(mv))
        self._head += mv[:take]
        self.received += take
        if self._head_len is None and len(self._head) == HEADER.size:
            meta_len, _, _ = read_header(self._head, self.max_bytes)
            self._head_len = align(HEADER.size + meta_len)
        if self._head_len is not None and len(self._head) == self._head_len:
            meta_len, meta_crc, data_len = read_header(self._head, self.max_bytes)
            meta = memoryview(self._head)[HEADER.size : HEADER.size + meta_len]
            layout = read_layout(meta, meta_crc, data_len, self.expected)
            meta.release()
            try:
                region = receive_region(layout.data_len)
                values = [empty_tensor(t) if region is None or not t.nbytes else region_view(region, t) for t in layout.tensors]
            except (OSError, MemoryError, RuntimeError) as exc:  # mmap's ENOMEM, torch's failed allocation
                raise PayloadTooLarge(f"cannot allocate the {layout.data_len} bytes the message declares: {exc}") from None
            for t, value in zip(layout.tensors, values):
                self._values[(t.group, t.name)] = value
                if t.nbytes:
                    start = layout.data_start + t.offset
                    self._targets.append((start, start + t.nbytes, bytes_of(value)))
            self._layout = layout
            self._head = bytearray()
        return mv[take:]

    def _feed_data(self, mv: memoryview) -> None:
        base = position = self.received
        end = base + len(mv)
        while self._next < len(self._targets) and position < end:
            start, stop, dest = self._targets[self._next]
            if stop <= position:
                self._next += 1
                continue
            if start >= end:
                return
            lo, hi = max(start, position), min(stop, end)
            dest[lo - start : hi - start] = mv[lo - base : hi - base]
            if hi == stop:
                self._next += 1
            position = hi

    def finish(self) -> Message:
        if self._layout is None:
            raise SerializationError(f"truncated message: {self.received} bytes, the header and metadata are incomplete")
        if not self.complete:
            raise SerializationError(f"truncated message: {self.received} of {self._layout.total} bytes arrived")
        message = build_message(self._layout, self._values)
        self._values, self._targets = {}, []
        return message
