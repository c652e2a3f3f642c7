"""Frames: a message as a bounded stream of checked chunks, for streaming transports."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator

from fedweave.errors import PayloadTooLarge, SerializationError
from fedweave.transports.serialization.encode import iter_chunks
from fedweave.transports.serialization.format import CHUNK_BYTES, Expected
from fedweave.transports.serialization.stream import StreamDecoder
from fedweave.types import Message

try:  # the same CRC-32 as zlib's, about 3x faster (carry-less multiply); installed by the grpc extra
    from isal.isal_zlib import crc32 as chunk_crc32
except ImportError:
    chunk_crc32 = zlib.crc32

FRAME = struct.Struct("<BBHIIQ")
"""kind u8 | flags u8 | reserved u16 | seq u32 | crc32 u32 | offset u64 (then the chunk)."""
DATA = 1
FLAG_CRC = 1


def encode_frames(message: Message, chunk_bytes: int = CHUNK_BYTES, checksum: bool = True) -> Iterator[bytes]:
    """The message as DATA frames of at most ``chunk_bytes`` payload each (one copy per chunk)."""
    offset = 0
    for seq, chunk in enumerate(iter_chunks(message, chunk_bytes)):
        crc = chunk_crc32(chunk) if checksum else 0
        yield b"".join((FRAME.pack(DATA, FLAG_CRC if checksum else 0, 0, seq, crc, offset), chunk))
        offset += len(chunk)


class FrameDecoder:
    """Checks DATA frames (order, size, checksum) and feeds them to a :class:`StreamDecoder`."""

    def __init__(
        self,
        *,
        max_chunk_bytes: int = CHUNK_BYTES,
        max_bytes: int | None = None,
        expected: Expected | None = None,
        require_checksum: bool = False,
    ):
        self.max_chunk_bytes = max_chunk_bytes
        self.require_checksum = require_checksum
        self.stream = StreamDecoder(max_bytes=max_bytes, expected=expected)
        self.seq = 0

    def feed(self, frame: bytes | bytearray | memoryview) -> None:
        mv = memoryview(frame)
        if len(mv) < FRAME.size:
            raise SerializationError(f"corrupted chunk {self.seq}: {len(mv)} bytes, shorter than a frame header")
        kind, flags, _, seq, crc, offset = FRAME.unpack_from(mv)
        payload = mv[FRAME.size :]
        if kind != DATA:
            raise SerializationError(f"corrupted chunk {self.seq}: frame kind {kind} is not a data frame")
        if len(payload) > self.max_chunk_bytes:
            raise PayloadTooLarge(
                f"chunk {seq} of {len(payload)} bytes exceeds the maximum chunk of {self.max_chunk_bytes} bytes"
            )
        if seq != self.seq or offset != self.stream.received:
            raise SerializationError(
                f"corrupted stream: chunk {seq} at byte {offset} arrived where chunk {self.seq} at byte "
                f"{self.stream.received} was due"
            )
        if flags & FLAG_CRC:
            if chunk_crc32(payload) != crc:
                raise SerializationError(f"corrupted chunk {seq}: CRC-32 mismatch")
        elif self.require_checksum:
            raise SerializationError(f"chunk {seq} carries no checksum, which this receiver requires")
        self.stream.feed(payload)
        self.seq += 1

    @property
    def complete(self) -> bool:
        return self.stream.complete

    def finish(self) -> Message:
        return self.stream.finish()
