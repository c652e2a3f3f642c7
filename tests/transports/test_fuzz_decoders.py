"""Property tests of every decoder a peer's bytes reach: whatever arrives, a decoder returns a
message or raises SerializationError, never anything else.

A few hundred examples per decoder (derandomized, so CI is reproducible); the full budget of
10,000 mutated messages is ``benchmarks/fuzz_decoders.py``, whose own mutations run here too.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import load_script
from fedweave.errors import SerializationError
from fedweave.transports import serialization as ser
from fedweave.transports.grpc import protocol as p
from fedweave.types import Control, Evaluation, Instruction, Message, TaskKind, Update, UpdateKind, Work

EXAMPLES = settings(
    max_examples=300, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)
PARAMS = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "n": torch.tensor([1, 2])}
EXPECTED = {k: tuple(v.shape) for k, v in PARAMS.items()}


def corpus() -> list[bytes]:
    members = [Message(1, c, Instruction(1, TaskKind.TRAIN, Work(c, 4), PARAMS)) for c in (2, 3)]
    update = Update(UpdateKind.DELTA, PARAMS, num_examples=9, metrics={"loss": 0.5}, client_id=2,
                    extras={"c": torch.ones(2)}, clients=2, members=[2, 3])
    bodies: list[Message] = [
        Message(1, 2, Instruction(1, TaskKind.TRAIN, Work(2, 4), PARAMS, config={"lr": 0.1}, extras={"c": torch.ones(3)})),
        Message(1, 2, update),
        Message(1, 2, Evaluation(num_examples=3, metrics={"accuracy": 1.0}, client_id=2)),
        Message(1, 2, Control("secagg", "keys", {"pk": torch.arange(8, dtype=torch.uint8)})),
        Message(1, 0, ser.SiteJob(members, timeout=5.0)),
        Message(1, 0, ser.SiteReply([Message(1, 2, Update(UpdateKind.WEIGHTS, PARAMS, 4, client_id=2))], {3: "lost"})),
        Message(1, 0, ser.SiteReply([], {2: "site group broken: gone", 3: "site group broken: gone"}, "gone")),
    ]
    return [bytes(ser.encode(m)) for m in bodies]


CORPUS = corpus()


def decodes_or_rejects(data: bytes, chunk: int = 7) -> None:
    """``data`` through the whole-buffer (read-only and writable), stream and frame decoders."""
    attempts = [
        lambda: ser.decode(data, max_bytes=1 << 20),
        lambda: ser.decode(bytearray(data), expected=EXPECTED),
        lambda: _stream(data, chunk),
        lambda: _frames(data, max(chunk, 16)),
    ]
    for attempt in attempts:
        try:
            assert isinstance(attempt(), Message)
        except SerializationError:
            pass


def _stream(data: bytes, chunk: int) -> Message:
    decoder = ser.StreamDecoder()  # no size limit: a declared size reaches the allocation
    for at in range(0, len(data), chunk):
        decoder.feed(data[at : at + chunk])
    return decoder.finish()


def _frames(data: bytes, chunk: int) -> Message:
    decoder = ser.FrameDecoder(max_chunk_bytes=chunk, max_bytes=1 << 20, require_checksum=True)
    for seq, at in enumerate(range(0, len(data), chunk)):
        piece = data[at : at + chunk]
        decoder.feed(ser.FRAME.pack(ser.DATA, ser.FLAG_CRC, 0, seq, zlib.crc32(piece), at) + piece)
    return decoder.finish()


def with_meta(data: bytes, meta_text: bytes, data_len: int | None = None) -> bytes:
    """``data`` with its metadata replaced by ``meta_text`` (length and checksum made to match)."""
    magic, version, flags, meta_len, _, old_data = ser.HEADER.unpack_from(data)
    tail = data[len(data) - old_data :] if old_data else b""
    head = ser.HEADER.pack(magic, version, flags, len(meta_text), zlib.crc32(meta_text),
                           old_data if data_len is None else data_len) + meta_text
    return head + bytes(ser.align(len(head)) - len(head)) + tail


def meta_of(data: bytes) -> Any:
    meta_len = ser.HEADER.unpack_from(data)[3]
    return json.loads(data[ser.HEADER.size : ser.HEADER.size + meta_len])


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else []
    for key, inner in items:
        out.append(prefix + (key,))
        out.extend(_paths(inner, prefix + (key,)))
    return out


@EXAMPLES
@given(st.binary(max_size=400))
def test_any_bytes_are_decoded_or_rejected(data: bytes) -> None:
    decodes_or_rejects(data)


@EXAMPLES
@given(st.sampled_from(CORPUS), st.data())
def test_truncated_flipped_or_grown_messages_are_decoded_or_rejected(data: bytes, draw: st.DataObject) -> None:
    how = draw.draw(st.sampled_from(["truncate", "flip", "insert", "flip-meta"]))
    out = bytearray(data)
    if how == "truncate":
        out = out[: draw.draw(st.integers(0, len(out) - 1))]
    elif how == "insert":
        at = draw.draw(st.integers(0, len(out)))
        out[at:at] = draw.draw(st.binary(min_size=1, max_size=32))
    else:
        meta_end = ser.HEADER.size + ser.HEADER.unpack_from(data)[3]
        top = meta_end if how == "flip-meta" else len(out)
        for at in draw.draw(st.lists(st.integers(0, top - 1), min_size=1, max_size=8)):
            out[at] ^= 1 << draw.draw(st.integers(0, 7))
        if how == "flip-meta":  # past the checksum, into the parser
            out = bytearray(with_meta(data, bytes(out[ser.HEADER.size : meta_end])))
    decodes_or_rejects(bytes(out), chunk=draw.draw(st.integers(1, 300)))


@EXAMPLES
@given(st.sampled_from(CORPUS), st.data())
def test_any_metadata_field_replaced_by_any_json_is_decoded_or_rejected(data: bytes, draw: st.DataObject) -> None:
    meta = meta_of(data)
    path = draw.draw(st.sampled_from(_paths(meta)))
    target = meta
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = draw.draw(JSON)
    decodes_or_rejects(with_meta(data, json.dumps(meta).encode()))


@EXAMPLES
@given(JSON)
def test_any_json_as_the_whole_metadata_is_rejected(value: Any) -> None:
    with pytest.raises(SerializationError):
        ser.decode(with_meta(CORPUS[0], json.dumps(value).encode()))


@EXAMPLES
@given(st.sampled_from(CORPUS), st.sampled_from([3, 5]), st.integers(0, (1 << 32) - 1), st.integers(0, 8))
def test_any_declared_size_is_decoded_or_rejected(data: bytes, field: int, value: int, shift: int) -> None:
    fields = list(ser.HEADER.unpack_from(data))
    fields[field] = value << (8 * shift) if field == 5 else value
    fields[field] = min(fields[field], (1 << (32 if field == 3 else 64)) - 1)
    decodes_or_rejects(ser.HEADER.pack(*fields) + data[ser.HEADER.size :])


@EXAMPLES
@given(st.binary(max_size=300) | JSON.map(lambda v: p.FRAME.pack(p.CONTROL, 0, 0, 0, 0, 0) + json.dumps(v).encode()))
def test_any_control_frame_is_parsed_or_rejected(frame: bytes) -> None:
    try:
        control = p.parse_control(frame)
        assert control is None or isinstance(control["type"], str)
        p.inline_frame(frame)
    except SerializationError:
        pass


@EXAMPLES
@given(st.binary(max_size=300) | JSON.map(lambda v: json.dumps(v).encode()))
def test_any_request_is_parsed_or_rejected(data: bytes) -> None:
    try:
        assert isinstance(p.decode_json(data), dict)
    except SerializationError:
        pass


@EXAMPLES
@given(st.text(max_size=25))
def test_a_node_id_is_ascii_digits_or_nothing(text: str) -> None:
    value = ser.ascii_id(text)
    if value is None:
        assert not (text.isascii() and text.isdigit() and 0 < len(text) <= 18)
    else:
        assert text.isascii() and text.isdigit() and value == int(text)


def test_the_fuzz_script_finds_no_other_exception_in_its_first_300_inputs() -> None:
    path = Path(__file__).parents[2] / "benchmarks" / "fuzz_decoders.py"
    script = load_script(path)
    outcomes, first = script.run(300, seed=1)
    assert first == {} and outcomes["inputs with another exception"] == 0
    assert outcomes["decoded"] > 30 and outcomes["rejected"] > 300  # it exercised both ways out
