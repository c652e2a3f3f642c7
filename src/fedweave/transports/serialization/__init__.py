"""The binary wire format of a :class:`~fedweave.types.Message`, whole or in chunks.

One message is laid out as::

    offset 0   header (24 bytes, little-endian)
               magic b"FWMS" | version u16 | flags u16 (0) | meta_len u32 | meta_crc32 u32 | data_len u64
    24         metadata: UTF-8 JSON, meta_len bytes (round, client id, the body's scalar
               fields, and per tensor [group, name, dtype, shape, offset, nbytes])
    ...        zero padding up to a multiple of 64
    data_start tensor bytes; each tensor starts at a multiple of 64 after data_start,
               in the order listed, with zero padding between them; data_len bytes

Tensors are stored raw and little-endian, C-contiguous, in their own dtype (fp32, fp16,
bf16, fp64, int8, int16, int32, int64, uint8, bool). The receiver validates everything before
it builds anything: magic, version, sizes against a configurable maximum, the
metadata's checksum and schema, every name, dtype, shape and offset, and, when it is
given the names and shapes it expects, that the tensors match them. Any problem is a
:class:`~fedweave.errors.SerializationError` (``PayloadTooLarge`` for sizes,
``PayloadMismatch`` for unexpected tensors); a message is returned whole or not at all.

Zero copy: :func:`iter_chunks` slices the tensors' own memory (no copy of the model
is made to send it); :func:`decode` of a writable buffer returns tensors that are views
into it (``torch.frombuffer``); :class:`StreamDecoder` copies each incoming chunk once,
straight into the final tensor, so a receiver holds the payload plus one chunk.

For streaming transports, :func:`encode_frames` wraps each ~1 MiB chunk in a 20-byte
frame (kind, flags, sequence number, CRC-32 of the chunk, offset) and
:class:`FrameDecoder` checks each frame (order, size, checksum) before feeding it to
a :class:`StreamDecoder`. No frame holds the whole message, so a message of any size
(also over 2 GB) travels as a bounded stream.

A :class:`~fedweave.types.Control` body (a step of a plugin's own protocol, such as
secure aggregation's key set-up) carries its plugin and step names, checked to be short
identifiers, and one group of tensors, which its plugin checks.

Site batches: a :class:`SiteJob` (a gRPC site leader's round: every member's instruction,
or every member's control step) and a :class:`SiteReply` (the members' updates,
evaluations or control answers, or one pre-aggregated update, each failed member's
reason, and why the site's group is broken, when it is) are one message each. Their metadata lists the
inner messages (``items``: client id, body kind, fields, and per tensor group a name ->
pool index map); their tensors are a ``pool`` in which a tensor shared by several inner
messages (the global model every member receives) travels once. Decoding checks every
item as a message of its own, every pool index, that every pooled tensor is used, and
that each item belongs to the batch's round.

Modules: :mod:`.format` (constants), :mod:`.encode`,
:mod:`.strict_json` (a peer's JSON), :mod:`.decode`, :mod:`.stream` (:class:`StreamDecoder`)
and :mod:`.frames`; this package re-exports their public names, and the site batches of
:mod:`fedweave.types`.
"""

from __future__ import annotations

from fedweave.errors import PayloadMismatch, PayloadTooLarge, SerializationError
from fedweave.transports.serialization.decode import HUGE_PAGE_BYTES, decode, receive_region
from fedweave.transports.serialization.encode import encode, encoded_size, iter_chunks
from fedweave.transports.serialization.format import (
    ALIGN,
    CHUNK_BYTES,
    DTYPES,
    HEADER,
    MAGIC,
    MAX_ELEMENTS,
    MAX_INT,
    MAX_META_BYTES,
    MAX_NDIM,
    VERSION,
    Expected,
    align,
)
from fedweave.transports.serialization.frames import DATA, FLAG_CRC, FRAME, FrameDecoder, chunk_crc32, encode_frames
from fedweave.transports.serialization.stream import StreamDecoder
from fedweave.types import SiteJob, SiteReply
from fedweave.transports.serialization.strict_json import ascii_id, load_json

__all__ = [
    "ALIGN",
    "CHUNK_BYTES",
    "DATA",
    "DTYPES",
    "FLAG_CRC",
    "FRAME",
    "HEADER",
    "HUGE_PAGE_BYTES",
    "MAGIC",
    "MAX_ELEMENTS",
    "MAX_INT",
    "MAX_META_BYTES",
    "MAX_NDIM",
    "VERSION",
    "Expected",
    "FrameDecoder",
    "PayloadMismatch",
    "PayloadTooLarge",
    "SerializationError",
    "SiteJob",
    "SiteReply",
    "StreamDecoder",
    "align",
    "ascii_id",
    "chunk_crc32",
    "decode",
    "encode",
    "encode_frames",
    "encoded_size",
    "iter_chunks",
    "load_json",
    "receive_region",
]
