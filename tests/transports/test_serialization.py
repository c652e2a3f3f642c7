"""The wire format: round trips of every dtype and body, zero copy, and one rejection per malformation."""

from __future__ import annotations

import json
import struct
import zlib
from typing import Any

import pytest
import torch

from fedweave.errors import PayloadMismatch, PayloadTooLarge, SerializationError
from fedweave.plugins import PLUGINS
from fedweave.plugins.contracts import PluginContext
from fedweave.transports import serialization as ser
from fedweave.types import ACCEPTED_ROUND, Control, Evaluation, Instruction, Message, TaskKind, Update, UpdateKind, Work

DTYPES = list(ser.DTYPES.values())


def sample(dtype: torch.dtype, shape: tuple[int, ...] = (3, 5)) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=dtype)


def instruction(params: dict[str, torch.Tensor], **kw: Any) -> Message:
    body = Instruction(
        round=3,
        task=TaskKind.TRAIN,
        work=Work(client_id=2, batch_size=16, epochs=1, local_steps=7),
        params=params,
        config={"lr": 0.1, "mu": 0.01, "note": "x"},
        extras={"c": torch.ones(4)},
        applied=kw.pop("applied", []),
    )
    return Message(3, 2, body)


def update(tensors: dict[str, torch.Tensor], **kw: Any) -> Message:
    body = Update(
        kind=UpdateKind.DELTA,
        tensors=tensors,
        num_examples=42,
        metrics={"train_loss": 0.25},
        extras={"dc": torch.zeros(2, dtype=torch.float64)},
        applied=kw.pop("applied", []),
        client_id=2,
        local_steps=5,
        compute_time=1.5,
    )
    return Message(3, 2, body)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


def decoders(msg: Message, **kw: Any) -> list[Message]:
    """The message through every decoding path: whole (copy / zero copy), stream, frames."""
    buf = ser.encode(msg)
    out = [ser.decode(bytes(buf), **kw), ser.decode(bytearray(buf), **kw)]
    for chunk in (1, 7, 100, 1 << 20):
        stream = ser.StreamDecoder(**kw)
        for piece in ser.iter_chunks(msg, chunk):
            stream.feed(piece)
        out.append(stream.finish())
    frames = ser.FrameDecoder(max_chunk_bytes=64, require_checksum=True, **kw)
    for frame in ser.encode_frames(msg, 64):
        frames.feed(frame)
    out.append(frames.finish())
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_round_trips(dtype: torch.dtype) -> None:
    params = {
        "w": sample(dtype),
        "scalar": sample(dtype, ()),
        "empty": sample(dtype, (0, 4)),
        "transposed": sample(dtype, (4, 6)).t(),  # non-contiguous input
        "big": sample(dtype, (33, 17, 3)),
    }
    for got in decoders(instruction(params)):
        same(params, got.body.params)
        assert got.body.work == Work(2, 16, 1, 7)
        assert got.body.config == {"lr": 0.1, "mu": 0.01, "note": "x"}


CODECS = [("topk", {"ratio": 0.01}), ("topk", {"ratio": 0.01, "values": "bfloat16"}), ("randk", {}),
          ("qsgd", {"levels": 7}), ("qsgd", {"levels": 127}), ("qsgd", {"levels": 1000}), ("quantize", {"dtype": "int8"}),
          ("quantize", {"dtype": "float16"}), ("quantize", {"dtype": "bfloat16"}), ("powersgd", {})]


@pytest.mark.parametrize("name,params", CODECS, ids=lambda v: str(v) if isinstance(v, str) else "-".join(map(str, v.values())))
def test_every_codecs_fields_cross_the_wire(name: str, params: dict[str, Any]) -> None:
    """Whatever dtype a built-in compressor gives its fields (top-k's int16 positions and int32
    block counts, QSGD's uint8, int8 or int16 levels, random-k's int64 seed) is carried."""
    cls = PLUGINS.get(name, "test")
    g = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(300, 300, generator=g), "b": torch.randn(10, generator=g), "n": torch.tensor(7)}
    encoded = cls(cls.HParams(**params)).encode(Update(UpdateKind.DELTA, tensors, 10), PluginContext(1, 0, "client"))
    msg = update(encoded.tensors, applied=[name])
    for out in decoders(msg):
        same(out.body.tensors, msg.body.tensors)


def test_special_float_values_survive() -> None:
    values = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40, 65504.0])
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        t = values.to(dtype)
        got = ser.decode(ser.encode(update({"t": t}))).body.tensors["t"]
        assert torch.equal(got.view(torch.uint8), t.view(torch.uint8))  # bit for bit


def test_update_and_evaluation_round_trip() -> None:
    msg = update({"a": sample(torch.float32)}, applied=["topk"])
    for got in decoders(msg):
        assert got.round == 3 and got.client_id == 2
        b = got.body
        assert (b.kind, b.num_examples, b.metrics, b.applied) == (UpdateKind.DELTA, 42, {"train_loss": 0.25}, ["topk"])
        assert (b.client_id, b.local_steps, b.compute_time) == (2, 5, 1.5)
        same(msg.body.tensors, b.tensors)
        same(msg.body.extras, b.extras)
    ev = Message(4, 1, Evaluation(num_examples=9, metrics={"accuracy": 0.5}, client_id=1))
    for got in decoders(ev):
        assert got == ev


def test_the_accepted_round_travels_in_the_instruction_config() -> None:
    msg = instruction({"w": sample(torch.float32)})
    msg.body.config[ACCEPTED_ROUND] = 2
    for got in decoders(msg):
        accepted = got.body.config[ACCEPTED_ROUND]
        assert accepted == 2 and type(accepted) is int  # the client compares it with its pending round


def test_decode_of_a_writable_buffer_is_zero_copy() -> None:
    buf = ser.encode(update({"w": torch.arange(1000, dtype=torch.float32)}))
    got = ser.decode(buf).body.tensors["w"]
    base = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    assert base <= got.data_ptr() < base + len(buf)  # a view into the buffer, no copy
    got[0] = 7.0  # writable, and shares the buffer's memory
    assert ser.decode(buf).body.tensors["w"][0] == 7.0


def test_decode_of_read_only_bytes_copies_into_writable_tensors() -> None:
    data = bytes(ser.encode(update({"w": torch.arange(10, dtype=torch.float32)})))
    got = ser.decode(data).body.tensors["w"]
    got += 1  # no warning, no write into an immutable buffer
    assert ser.decode(data).body.tensors["w"][0] == 0
    with pytest.raises(ValueError, match="writable"):
        ser.decode(data, copy=False)


def test_chunks_of_a_large_tensor_are_views_of_its_memory() -> None:
    t = torch.randn(1 << 16)  # 256 KiB
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * 4
    chunks = list(ser.iter_chunks(update({"t": t}), 1 << 14))
    views = [c for c in chunks if isinstance(c, memoryview)]
    assert len(views) >= 14
    for view in views:
        assert start <= torch.frombuffer(view, dtype=torch.uint8).data_ptr() < end
    assert all(len(c) == 1 << 14 for c in chunks[:-1])


def test_stream_decoder_allocates_each_tensor_once() -> None:
    msg = update({"w": torch.randn(4096)})
    stream = ser.StreamDecoder()
    pieces = list(ser.iter_chunks(msg, 1000))
    stream.feed(pieces[0])
    assert stream.total == ser.encoded_size(msg)
    target = stream._values[("tensors", "w")].data_ptr()
    for piece in pieces[1:]:
        stream.feed(piece)
    got = stream.finish().body.tensors["w"]
    assert got.data_ptr() == target  # the chunks were copied straight into the final tensor
    assert torch.equal(got, msg.body.tensors["w"])


def test_a_large_streamed_message_lands_in_one_huge_page_region() -> None:
    size = ser.HUGE_PAGE_BYTES // 4  # float32: exactly the threshold
    params = {"a": torch.randn(size // 2), "empty": torch.ones(0), "b": torch.arange(size // 2, dtype=torch.float32)}
    msg = instruction(params)
    stream = ser.StreamDecoder()
    for piece in ser.iter_chunks(msg, 1 << 20):
        stream.feed(piece)
    got = stream.finish().body.params
    same(params, got)
    region = ser.receive_region(1)  # below the threshold: plain tensors
    assert region is None
    a, b = got["a"], got["b"]
    # one mapping holds the message's tensor data, each tensor at its wire offset
    assert b.data_ptr() - a.data_ptr() == -(-a.numel() * 4 // ser.ALIGN) * ser.ALIGN
    b += 1  # writable, and independent of the sender's tensors
    assert torch.equal(b, params["b"] + 1)
    assert stream._values == {}  # the decoder keeps nothing after finish


def test_the_chunk_checksum_is_zlibs_crc32() -> None:
    data = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    view = memoryview(data.numpy())
    assert ser.chunk_crc32(view) == zlib.crc32(view)
    assert ser.chunk_crc32(view[5:1001]) == zlib.crc32(bytes(view[5:1001]))


# --------------------------------------------------------------------------- malformations


def forge(meta: dict[str, Any], data: bytes = b"", *, magic: bytes = ser.MAGIC, version: int = ser.VERSION, flags: int = 0) -> bytes:
    """A message with arbitrary metadata and a correct header (so only the metadata is wrong)."""
    raw = json.dumps(meta).encode()
    head = ser.HEADER.pack(magic, version, flags, len(raw), zlib.crc32(raw), len(data)) + raw
    head += bytes(-len(head) % ser.ALIGN)
    return head + data


def good_meta() -> tuple[dict[str, Any], bytes]:
    buf = ser.encode(update({"w": torch.ones(2, 3)}))
    _, _, _, meta_len, _, _ = ser.HEADER.unpack_from(buf)
    meta = json.loads(bytes(buf[ser.HEADER.size : ser.HEADER.size + meta_len]))
    data_start = -(-(ser.HEADER.size + meta_len) // ser.ALIGN) * ser.ALIGN
    return meta, bytes(buf[data_start:])


def test_forge_is_faithful() -> None:
    meta, data = good_meta()
    assert torch.equal(ser.decode(forge(meta, data)).body.tensors["w"], torch.ones(2, 3))


def mutate(change: Any) -> bytes:
    meta, data = good_meta()
    result = change(meta)
    return forge(meta if result is None else result, data)


MALFORMED = {
    "not a mapping": lambda m: [1, 2],
    "extra top-level key": lambda m: {**m, "evil": 1},
    "negative round": lambda m: m.update(round=-1),
    "unknown body": lambda m: m.update(body="virus"),
    "missing field": lambda m: m["fields"].pop("num_examples"),
    "bool as int": lambda m: m["fields"].update(num_examples=True),
    "unknown update kind": lambda m: m["fields"].update(kind="poison"),
    "metric not a number": lambda m: m["fields"].update(metrics={"loss": "low"}),
    "entry not a list": lambda m: m.update(tensors=[{"name": "w"}]),
    "unknown group": lambda m: m["tensors"][0].__setitem__(0, "params"),
    "name not a string": lambda m: m["tensors"][0].__setitem__(1, 5),
    "unknown dtype": lambda m: m["tensors"][0].__setitem__(2, "complex64"),
    "negative dimension": lambda m: m["tensors"][0].__setitem__(3, [-2, -3]),
    "shape does not match size": lambda m: m["tensors"][0].__setitem__(3, [3, 3]),
    "offset out of place": lambda m: m["tensors"][0].__setitem__(4, 64),
    "nbytes lies": lambda m: m["tensors"][0].__setitem__(5, 4),
    "duplicate name": lambda m: m["tensors"].append(list(m["tensors"][0])),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_metadata_is_rejected(name: str) -> None:
    data = mutate(MALFORMED[name])
    with pytest.raises(SerializationError, match="malformed"):
        ser.decode(data)
    stream = ser.StreamDecoder()
    with pytest.raises(SerializationError):
        stream.feed(data)
        stream.finish()


def forge_text(text: str, data: bytes = b"") -> bytes:
    """A message whose metadata is ``text`` as written (JSON that Python's json would never write)."""
    raw = text.encode()
    head = ser.HEADER.pack(ser.MAGIC, ser.VERSION, 0, len(raw), zlib.crc32(raw), len(data)) + raw
    return head + bytes(-len(head) % ser.ALIGN) + data


def text_with(change: Any, value: str) -> str:
    """The good metadata as JSON text, one field (set to a marker by ``change``) written as ``value``."""
    meta, _ = good_meta()
    change(meta, "MARK")
    return json.dumps(meta).replace('"MARK"', value, 1)


HOSTILE = {
    # the six causes of non-project exceptions found by fuzzing (issue 14, item 5)
    "deep nesting": ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    "list as a dtype name": (lambda m, v: m["tensors"][0].__setitem__(2, ["float32"]), "unknown dtype"),
    "list as the body": (lambda m, v: m.update(body=["update"]), "unknown body"),
    "mapping as the update kind": (lambda m, v: m["fields"].update(kind={"delta": 1}), "unknown update kind"),
    "list as a group": (lambda m, v: m["tensors"][0].__setitem__(0, ["tensors"]), "group"),
    "10**400 as compute time": (lambda m, v: m["fields"].update(compute_time=v), "1" + "0" * 400, "out of range"),
    "1e400 as a metric": (lambda m, v: m["fields"]["metrics"].update(loss=v), "1e400", "out of range"),
    "NaN as a metric": (lambda m, v: m["fields"]["metrics"].update(loss=v), "NaN", "not a number JSON allows"),
    "2**63 examples": (lambda m, v: m["fields"].update(num_examples=2**63), "out of range"),
    "shape [0, 2**63]": (lambda m, v: m["tensors"][0].__setitem__(3, [0, 2**63]), "out of range"),
    "shape [0, 2**62, 2**62]": (lambda m, v: m["tensors"][0].__setitem__(3, [0, 2**62, 2**62]), "bad shape"),
    "shape of 70 dimensions": (lambda m, v: m["tensors"][0].__setitem__(3, [1] * 70), "bad shape"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_metadata_is_a_serialization_error(name: str) -> None:
    """Never RecursionError, TypeError, OverflowError or ValueError: only the project's rejection."""
    case = HOSTILE[name]
    if isinstance(case[0], str):
        data = forge_text(case[0])
    elif len(case) == 3:
        data = forge_text(text_with(case[0], case[1]), good_meta()[1])
    else:
        data = mutate(lambda m: case[0](m, None))
    why = case[-1]
    with pytest.raises(SerializationError, match=why):
        ser.decode(data)
    stream = ser.StreamDecoder()
    with pytest.raises(SerializationError, match=why):
        stream.feed(data)
        stream.finish()


def test_a_declared_size_no_memory_can_hold_is_too_large_not_an_os_error() -> None:
    """A header and metadata that agree on a 1 PiB tensor, with no size limit set: the allocation
    fails (ENOMEM on any machine) and that is a PayloadTooLarge, not an OSError."""
    meta, _ = good_meta()
    numel = 1 << 48
    meta["tensors"] = [["tensors", "w", "float32", [numel], 0, 4 * numel]]
    raw = json.dumps(meta).encode()
    head = ser.HEADER.pack(ser.MAGIC, ser.VERSION, 0, len(raw), zlib.crc32(raw), 4 * numel) + raw
    stream = ser.StreamDecoder()
    with pytest.raises(PayloadTooLarge, match=f"cannot allocate the {4 * numel} bytes"):
        stream.feed(head + bytes(-len(head) % ser.ALIGN))
    everything = ser.HEADER.pack(ser.MAGIC, ser.VERSION, 0, len(raw), zlib.crc32(raw), (1 << 64) - 1)
    with pytest.raises(PayloadTooLarge, match="exceeds any size"):
        ser.StreamDecoder().feed(everything)


def test_extras_count_toward_the_size_limit() -> None:
    """A 3-entry model's update may not smuggle a large extras tensor past the limit."""
    msg = update({"w": torch.ones(3)})
    msg.body.extras = {"dc": torch.zeros(1 << 20)}
    limit = ser.encoded_size(update({"w": torch.ones(3)})) + 1024
    with pytest.raises(PayloadTooLarge):
        ser.decode(ser.encode(msg), max_bytes=limit)
    frames = ser.FrameDecoder(max_bytes=limit)
    with pytest.raises(PayloadTooLarge):
        for frame in ser.encode_frames(msg):
            frames.feed(frame)


def test_the_default_message_limit_fits_a_machine() -> None:
    from fedweave.config import GrpcConfig

    assert GrpcConfig().max_message_mb == 2048  # 64 GiB before: more than most machines hold


def test_a_node_id_is_read_from_ascii_digits_only() -> None:
    assert [ser.ascii_id(t) for t in ("0", "17", "007")] == [0, 17, 7]
    for text in ("٥", "²", "-1", " 5", "5\n", "", "1" * 19, "0x5", 5, None, ["5"]):
        assert ser.ascii_id(text) is None, text


def test_header_problems_are_rejected() -> None:
    meta, data = good_meta()
    cases = {
        "not a fedweave message": forge(meta, data, magic=b"HTTP"),
        "version 9 is not supported": forge(meta, data, version=9),
        "unknown flags": forge(meta, data, flags=4),
        "shorter than the 24-byte header": forge(meta, data)[:10],
        "not UTF-8 JSON": _with_meta(b"\xff\xfe{"),
    }
    for message, blob in cases.items():
        with pytest.raises(SerializationError, match=message):
            ser.decode(blob)


def _with_meta(raw: bytes) -> bytes:
    head = ser.HEADER.pack(ser.MAGIC, ser.VERSION, 0, len(raw), zlib.crc32(raw), 0) + raw
    return head + bytes(-len(head) % ser.ALIGN)


def test_corrupted_metadata_fails_its_checksum() -> None:
    buf = bytearray(ser.encode(update({"w": torch.ones(3)})))
    buf[ser.HEADER.size + 5] ^= 0x20
    with pytest.raises(SerializationError, match="checksum"):
        ser.decode(buf)


def test_truncated_and_overlong_messages_are_rejected() -> None:
    buf = bytes(ser.encode(update({"w": torch.ones(100)})))
    for cut in (30, ser.HEADER.size + 10, len(buf) - 1):
        with pytest.raises(SerializationError, match="truncated"):
            ser.decode(buf[:cut])
        stream = ser.StreamDecoder()
        stream.feed(buf[:cut])
        with pytest.raises(SerializationError, match="truncated"):
            stream.finish()
    with pytest.raises(SerializationError, match="malformed message"):
        ser.decode(buf + b"\0")
    stream = ser.StreamDecoder()
    with pytest.raises(SerializationError, match="more bytes"):
        stream.feed(buf + b"\0")


def test_invalid_bool_bytes_are_rejected() -> None:
    msg = update({"b": torch.tensor([True, False])})
    msg.body.extras = {}
    buf = bytearray(ser.encode(msg))
    buf[-1] = 7
    with pytest.raises(SerializationError, match="bool"):
        ser.decode(buf)


def test_oversized_message_is_rejected_before_allocation() -> None:
    msg = update({"w": torch.ones(1000)})
    size = ser.encoded_size(msg)
    assert ser.decode(ser.encode(msg), max_bytes=size)
    with pytest.raises(PayloadTooLarge, match="exceeds"):
        ser.decode(ser.encode(msg), max_bytes=size - 1)
    # A header that declares 1 TB is refused from its first 24 bytes: nothing is allocated.
    huge = ser.HEADER.pack(ser.MAGIC, ser.VERSION, 0, 10, 0, 1 << 40)
    stream = ser.StreamDecoder(max_bytes=1 << 30)
    with pytest.raises(PayloadTooLarge):
        stream.feed(huge)


def test_mismatched_tensors_are_rejected() -> None:
    expected = {"w": (2, 3), "b": (3,)}
    ok = update({"w": torch.ones(2, 3)})  # a subset is fine (personal layers stay home)
    assert ser.decode(ser.encode(ok), expected=expected)
    with pytest.raises(PayloadMismatch, match="unexpected tensor 'evil'"):
        ser.decode(ser.encode(update({"evil": torch.ones(2, 3)})), expected=expected)
    with pytest.raises(PayloadMismatch, match=r"shape \[3, 2\], expected \[2, 3\]"):
        ser.decode(ser.encode(update({"w": torch.ones(3, 2)})), expected=expected)
    stream = ser.StreamDecoder(expected=expected)
    with pytest.raises(PayloadMismatch):
        for piece in ser.iter_chunks(update({"w": torch.ones(3, 2)}), 16):
            stream.feed(piece)
    # An encoded payload (a plugin was applied) carries other names: its plugin checks it.
    assert ser.decode(ser.encode(update({"w.values": torch.ones(2)}, applied=["topk"])), expected=expected)


def test_unserializable_messages_are_refused_when_encoding() -> None:
    with pytest.raises(SerializationError, match="complex64"):
        ser.encode(update({"z": torch.ones(2, dtype=torch.complex64)}))
    msg = instruction({"w": torch.ones(2)})
    msg.body.config["f"] = object()
    with pytest.raises(SerializationError, match="JSON"):
        ser.encode(msg)


# --------------------------------------------------------------------------- frames


def frames_of(msg: Message, chunk: int = 64) -> list[bytearray]:
    return [bytearray(f) for f in ser.encode_frames(msg, chunk)]


def feed_all(frames: list[bytearray], **kw: Any) -> Message:
    decoder = ser.FrameDecoder(**{"max_chunk_bytes": 64, **kw})
    for f in frames:
        decoder.feed(f)
    return decoder.finish()


def test_corrupted_chunk_is_rejected() -> None:
    frames = frames_of(update({"w": torch.randn(100)}))
    frames[3][-1] ^= 1
    with pytest.raises(SerializationError, match="corrupted chunk 3: CRC-32 mismatch"):
        feed_all(frames)


def test_oversized_chunk_is_rejected() -> None:
    frames = frames_of(update({"w": torch.randn(100)}), chunk=128)
    with pytest.raises(PayloadTooLarge, match="chunk 0 of 128 bytes exceeds the maximum chunk of 64"):
        feed_all(frames)


def test_reordered_lost_and_unchecked_chunks_are_rejected() -> None:
    frames = frames_of(update({"w": torch.randn(100)}))
    with pytest.raises(SerializationError, match="chunk 2 at byte 128 arrived where chunk 1"):
        feed_all([frames[0], frames[2]])
    with pytest.raises(SerializationError, match="truncated"):
        feed_all(frames[:-1])
    unchecked = [bytearray(f) for f in ser.encode_frames(update({"w": torch.randn(10)}), 64, checksum=False)]
    assert feed_all(unchecked)
    with pytest.raises(SerializationError, match="no checksum"):
        feed_all(unchecked, require_checksum=True)
    bad_kind = bytearray(frames[0])
    struct.pack_into("<B", bad_kind, 0, 9)
    with pytest.raises(SerializationError, match="not a data frame"):
        feed_all([bad_kind])


# --------------------------------------------------------------------------- site batches


def site_job(params: dict[str, torch.Tensor], ids: tuple[int, ...] = (4, 5, 7)) -> Message:
    extras = {"c": torch.full((4,), 2.0)}
    members = [
        Message(3, c, Instruction(3, TaskKind.TRAIN, Work(c, 8 + c), params, {"lr": 0.1 * c}, extras)) for c in ids
    ]
    return Message(3, 1, ser.SiteJob(members, timeout=12.5))


def site_reply() -> Message:
    pre = Update(UpdateKind.WEIGHTS, {"w": torch.arange(6.0).reshape(2, 3)}, 30, {"train_loss": 0.5}, client_id=4, clients=2, members=[4, 5])
    return Message(3, 1, ser.SiteReply([Message(3, 4, pre)], {7: "missed the round deadline (9 s)"}))


def test_a_site_job_carries_a_shared_model_once() -> None:
    params = {"w": torch.randn(50, 40), "b": torch.randn(40)}
    job = site_job(params)
    one = ser.encoded_size(Message(3, 4, job.body.messages[0].body))
    # three members' instructions, the model and the extras in the data section once
    assert ser.encoded_size(job) < one + 1024
    for decoded in decoders(job, expected={"w": (50, 40), "b": (40,)}):
        body = decoded.body
        assert isinstance(body, ser.SiteJob) and body.timeout == 12.5 and decoded.client_id == 1
        assert [m.client_id for m in body.messages] == [4, 5, 7]
        for m, sent in zip(body.messages, job.body.messages):
            assert m.round == 3 and m.body.work == sent.body.work and m.body.config == sent.body.config
            same(m.body.params, params)
            same(m.body.extras, sent.body.extras)
        assert body.messages[0].body.params["w"] is body.messages[2].body.params["w"]


def test_a_site_reply_round_trips_with_its_failures() -> None:
    reply = site_reply()
    evaluation = Message(3, 5, Evaluation(9, {"accuracy": 0.75}, client_id=5))
    reply.body.messages.append(evaluation)
    for decoded in decoders(reply, expected={"w": (2, 3)}):
        body = decoded.body
        assert isinstance(body, ser.SiteReply) and body.failures == {7: "missed the round deadline (9 s)"}
        (pre, ev) = body.messages
        assert pre.client_id == 4 and pre.body.clients == 2 and pre.body.num_examples == 30
        assert pre.body.members == [4, 5]  # the server tells each of them whether it applied their update
        same(pre.body.tensors, reply.body.messages[0].body.tensors)
        assert ev.body == evaluation.body
    with pytest.raises(PayloadMismatch, match="tensor 'w' has shape"):  # checked inside the batch too
        ser.decode(ser.encode(reply), expected={"w": (3, 2)})
    with pytest.raises(PayloadMismatch, match="unexpected tensor 'w'"):
        ser.decode(ser.encode(site_job({"w": torch.ones(2)})), expected={"v": (2,)})


def broken_reply() -> Message:
    """A site whose group is broken: every member of its job failed, and why the group broke."""
    why = "RuntimeError: not every rank of [0, 1, 2] took part in a gather within 6 s"
    return Message(3, 1, ser.SiteReply([], {c: f"site group broken: {why}" for c in (4, 5)}, why))


def test_a_site_reply_says_whether_its_site_s_group_is_broken() -> None:
    for decoded in decoders(broken_reply()):
        body = decoded.body
        assert isinstance(body, ser.SiteReply) and body.messages == [] and body.failures == broken_reply().body.failures
        assert body.broken == "RuntimeError: not every rank of [0, 1, 2] took part in a gather within 6 s"
    for decoded in decoders(site_reply(), expected={"w": (2, 3)}):
        assert decoded.body.broken is None  # a whole site's reply


def test_site_batches_hold_only_their_kind_of_message() -> None:
    with pytest.raises(SerializationError, match="a site_job cannot hold a message of kind 'update'"):
        ser.encode(Message(3, 1, ser.SiteJob([site_reply().body.messages[0]])))
    with pytest.raises(SerializationError, match="a site_reply cannot hold a message of kind 'instruction'"):
        ser.encode(Message(3, 1, ser.SiteReply([instruction({})])))
    with pytest.raises(SerializationError, match="cannot hold a message of kind 'site_job'"):
        ser.encode(Message(3, 1, ser.SiteReply([Message(3, 2, site_job({}).body)])))  # type: ignore[arg-type]


def control_job(ids: tuple[int, ...] = (4, 5, 7)) -> Message:
    """A site's members' control steps: a key list all of them receive, and shares for each alone."""
    keys = torch.arange(6, dtype=torch.int64).reshape(3, 2)
    steps = [
        Message(3, c, Control("secagg", "share", {"keys": keys, "shares": torch.full((2, 3), c, dtype=torch.uint8)}))
        for c in ids
    ]
    return Message(3, 1, ser.SiteJob(steps, timeout=4.0))


def control_reply() -> Message:
    answers = [Message(3, c, Control("secagg", "share", {"ack": torch.tensor([c, 10 * c])})) for c in (4, 5)]
    return Message(3, 1, ser.SiteReply(answers, {7: "missed the round deadline (3.6 s)"}))


def test_site_batches_carry_each_members_control_steps_and_answers() -> None:
    job = control_job()
    one = ser.encoded_size(Message(3, 4, job.body.messages[0].body))
    assert ser.encoded_size(job) < 3 * one  # the shared key list travels once, in the pool
    for decoded in decoders(job, expected={"w": (2,)}):  # control steps are not checked against a model
        body = decoded.body
        assert isinstance(body, ser.SiteJob) and body.timeout == 4.0
        assert [m.client_id for m in body.messages] == [4, 5, 7]
        for m, sent in zip(body.messages, job.body.messages):
            assert isinstance(m.body, Control) and (m.body.plugin, m.body.step) == ("secagg", "share")
            same(m.body.tensors, sent.body.tensors)  # each member's own shares
        assert body.messages[0].body.tensors["keys"] is body.messages[2].body.tensors["keys"]
    for decoded in decoders(control_reply()):
        body = decoded.body
        assert isinstance(body, ser.SiteReply) and body.failures == {7: "missed the round deadline (3.6 s)"}
        assert [(m.client_id, m.body.step, m.body.tensors["ack"].tolist()) for m in body.messages] == [
            (4, "share", [4, 40]),
            (5, "share", [5, 50]),
        ]


def batch_meta(msg: Message) -> tuple[dict[str, Any], bytes]:
    buf = ser.encode(msg)
    _, _, _, meta_len, _, _ = ser.HEADER.unpack_from(buf)
    meta = json.loads(bytes(buf[ser.HEADER.size : ser.HEADER.size + meta_len]))
    return meta, bytes(buf[-(-(ser.HEADER.size + meta_len) // ser.ALIGN) * ser.ALIGN :])


BATCH_MALFORMED = {
    "item of another round": ("reply", lambda m: m["fields"]["items"][0].update(round=2), "is for round 2"),
    "pool index out of range": ("reply", lambda m: m["fields"]["items"][0]["tensors"]["tensors"].update(w=1), "names no pool"),
    "unused pool tensor": ("reply", lambda m: m["fields"]["items"][0]["tensors"]["tensors"].clear(), "used by no item"),
    "unknown group": ("reply", lambda m: m["fields"]["items"][0]["tensors"].update(params={}), "tensor groups"),
    "instruction in a reply": ("reply", lambda m: m["fields"]["items"][0].update(body="instruction"), "cannot hold"),
    "bad inner field": ("reply", lambda m: m["fields"]["items"][0]["fields"].update(clients=0), "clients is not"),
    "members not one per client": ("reply", lambda m: m["fields"]["items"][0]["fields"].update(members=[4]), "members"),
    "member not an id": ("reply", lambda m: m["fields"]["items"][0]["fields"].update(members=[4, "5"]), "members"),
    "failure of an answering client": ("reply", lambda m: m["fields"]["failures"].update({"4": "x"}), "failure '4'"),
    "failure not a reason": ("reply", lambda m: m["fields"]["failures"].update({"7": 3}), "failure '7'"),
    "pool out of order": ("reply", lambda m: m["tensors"][0].__setitem__(1, "1"), "pool tensors"),
    "duplicate client": ("job", lambda m: m["fields"]["items"][1].update(client_id=4), "client_id 4"),
    "negative timeout": ("job", lambda m: m["fields"].update(timeout=-1), "timeout"),
    "items not a list": ("job", lambda m: m["fields"].update(items={}), "items is not a list"),
    "evaluation in a job": ("control_job", lambda m: m["fields"]["items"][0].update(body="evaluation"), "a site_job cannot hold a message of kind 'evaluation'"),
    "control step not a name": ("control_job", lambda m: m["fields"]["items"][1]["fields"].update(step="share; rm"), "control step 'share; rm' is not a name"),
    "control plugin missing": ("control_job", lambda m: m["fields"]["items"][1]["fields"].pop("plugin"), r"item 1: control fields are not \['plugin', 'step'\]"),
    "control with update fields": ("control_reply", lambda m: m["fields"]["items"][0]["fields"].update(clients=2), r"item 0: control fields are not"),
    "control with params": ("control_job", lambda m: m["fields"]["items"][0]["tensors"].update(params=m["fields"]["items"][0]["tensors"].pop("tensors")), "item 0: tensor groups are not of"),
    "control answer of an unknown kind": ("control_reply", lambda m: m["fields"]["items"][1].update(body="ack"), "cannot hold a message of kind 'ack'"),
    "control answer of a failed client": ("control_reply", lambda m: m["fields"]["failures"].update({"5": "x"}), "failure '5'"),
    "failure of a superscript two": ("reply", lambda m: m["fields"]["failures"].update({"²": "x"}), "failure '²'"),
    "failure of an Arabic-Indic five": ("reply", lambda m: m["fields"]["failures"].update({"\u0665": "x"}), "failure '\u0665'"),
    "failure named twice": ("reply", lambda m: m["fields"]["failures"].update({"07": "x"}), "failure '07'"),
    "broken site that answers": ("reply", lambda m: m["fields"].update(broken="x"), "broken is neither null nor the reason"),
    "broken not a reason": ("broken", lambda m: m["fields"].update(broken=5), "broken is neither null nor the reason"),
    "broken without a reason": ("broken", lambda m: m["fields"].update(broken=""), "broken is neither null nor the reason"),
    "broken field missing": ("broken", lambda m: m["fields"].pop("broken"), r"site_reply fields are not \['broken', 'failures', 'items'\]"),
}


@pytest.mark.parametrize("name", list(BATCH_MALFORMED))
def test_malformed_site_batches_are_rejected(name: str) -> None:
    which, change, why = BATCH_MALFORMED[name]
    batches = {
        "reply": site_reply, "job": lambda: site_job({"w": torch.ones(3)}), "control_job": control_job,
        "control_reply": control_reply, "broken": broken_reply,
    }
    meta, data = batch_meta(batches[which]())
    change(meta)
    with pytest.raises(SerializationError, match=f"malformed message metadata: .*{why}"):
        ser.decode(forge(meta, data))
