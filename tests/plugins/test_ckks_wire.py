"""The framing of a serialized TenSEAL CKKS vector, checked before TenSEAL's parser takes it on trust:
TenSEAL's own serialization passes; every other frame (no ciphertext, two, sizes that do not add up
or overflow TenSEAL's int sum, another scale, a foreign field, truncation) is refused with a reason."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from fedweave.plugins.secure.ckks_wire import check_vector

SCALE = 2.0**40


def varint(n: int) -> bytes:
    out = b""
    while True:
        low, n = n & 0x7F, n >> 7
        if not n:
            return out + bytes([low])
        out += bytes([low | 0x80])


def frame(sizes: list[int], ciphertexts: list[bytes], scale: float | None = SCALE) -> bytes:
    """A CKKSVectorProto as protobuf frames it: packed sizes (field 1), ciphertexts (2), scale (3)."""
    packed = b"".join(map(varint, sizes))
    out = b"\x0a" + varint(len(packed)) + packed if sizes else b""
    out += b"".join(b"\x12" + varint(len(c)) + c for c in ciphertexts)
    return out + (b"\x19" + struct.pack("<d", scale) if scale is not None else b"")


def test_tenseal_s_own_vector_passes_and_the_framer_here_is_tenseal_s(tmp_path: Path) -> None:
    import tenseal as ts

    context = ts.context(ts.SCHEME_TYPE.CKKS, 8192, coeff_mod_bit_sizes=[60, 40, 60])
    context.global_scale = SCALE
    vector = ts.ckks_vector(context, [0.5] * 1000)
    check_vector(vector.serialize(), 1000, SCALE)
    (ciphertext,) = vector.ciphertext()
    ciphertext.save(str(tmp_path / "ct"))
    assert frame([1000], [(tmp_path / "ct").read_bytes()]) == vector.serialize()


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (frame([4096], []), r"frames 0 ciphertexts holding \[4096\]"),  # TenSEAL: SIGSEGV at the first addition
        (frame([4096], [b"a", b"b"]), r"frames 2 ciphertexts"),
        (frame([2048, 2048], [b"a"]), r"holding \[2048, 2048\] values"),
        (frame([2**32 - 1, 4097], [b"a"]), r"holding \[4294967295, 4097\]"),  # TenSEAL's int sum: 4096
        (frame([], [b"a"]), r"holding \[\] values"),
        (frame([4096], [b"a"], 2.0**20), r"its scale is \[1048576.0\]"),
        (frame([4096], [b"a"], float("nan")), r"its scale is \[nan\]"),
        (frame([4096], [b"a"], None), r"its scale is \[\]"),
        (frame([4096], [b"a"]) + b"\x19" + struct.pack("<d", SCALE), r"its scale is \[1099511627776.0, 1099"),
        (frame([4096], [b"a"]) + b"\x20\x01", "field 4 \\(wire type 0\\)"),
        (frame([4096], [b"abc"])[:-12], "truncated"),
        (b"\x0a\x05\x80\x20", "truncated"),
        (b"\x08" + b"\xff" * 11, "longer than 10 bytes"),
    ],
)
def test_any_other_frame_is_refused_with_its_reason(data: bytes, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        check_vector(data, 4096, SCALE)


def test_sizes_may_come_unpacked_as_protobuf_allows() -> None:
    check_vector(b"\x08" + varint(4096) + frame([], [b"a"]), 4096, SCALE)
