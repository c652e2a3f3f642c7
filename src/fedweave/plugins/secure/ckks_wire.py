"""The framing of one serialized TenSEAL CKKS vector, checked before TenSEAL parses it.

TenSEAL's ``CKKSVectorProto`` (protobuf) holds the sizes of the vector's chunks (field 1),
its serialized SEAL ciphertexts (field 2) and its scale (field 3). TenSEAL's parser takes
these on trust: a vector without a ciphertext but with a size crashes the process at its
first addition (an out-of-bounds read: SIGSEGV), one with more ciphertexts than another
operand reads past that operand's, and the scale is the one products encode their plaintext
at. SEAL checks each ciphertext itself (its parameters, level, size), not how TenSEAL frames
them. :func:`check_vector` refuses every frame but the one fedweave's vectors have: one
ciphertext of ``size`` values at the federation's scale.
"""

from __future__ import annotations

import struct

SIZES = 0x0A  # field 1, length-delimited: packed uint32
SIZE = 0x08  # field 1, one varint (an unpacked repeated field)
CIPHERTEXT = 0x12  # field 2, length-delimited
SCALE = 0x19  # field 3, 64-bit: a double


def check_vector(data: bytes, size: int, scale: float) -> None:
    """Raise ValueError unless ``data`` frames exactly one ciphertext holding ``size`` values at ``scale``."""
    sizes: list[int] = []
    scales: list[float] = []
    ciphertexts = 0
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos, len(data))
        if key == SIZES:
            length, pos = _varint(data, pos, len(data))
            end = _end(data, pos, length)
            while pos < end:
                value, pos = _varint(data, pos, end)
                sizes.append(value)
        elif key == SIZE:
            value, pos = _varint(data, pos, len(data))
            sizes.append(value)
        elif key == CIPHERTEXT:
            length, pos = _varint(data, pos, len(data))
            pos = _end(data, pos, length)
            ciphertexts += 1
        elif key == SCALE:
            end = _end(data, pos, 8)
            scales.append(struct.unpack("<d", data[pos:end])[0])
            pos = end
        else:
            raise ValueError(f"its framing has field {key >> 3} (wire type {key & 7}), not a CKKS vector's")
    if ciphertexts != 1 or sizes != [size]:
        raise ValueError(
            f"it frames {ciphertexts} ciphertexts holding {sizes[:3]} values, not one ciphertext of {size}"
        )
    if scales != [scale]:
        raise ValueError(f"its scale is {scales[:3]}, not the federation's {scale:g}")


def _varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    """The varint at ``pos`` (at most 10 bytes, before ``end``) and the position after it."""
    value = 0
    for shift in range(0, 70, 7):
        if pos >= end:
            raise ValueError("its framing is truncated")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
    raise ValueError("its framing has a varint longer than 10 bytes")


def _end(data: bytes, pos: int, length: int) -> int:
    if pos + length > len(data):
        raise ValueError("its framing is truncated")
    return pos + length
