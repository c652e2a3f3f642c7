"""Fuzzing the wire decoders: mutated messages, or a coverage-guided atheris run.

    python benchmarks/fuzz_decoders.py [--count 10000] [--seed 0]
    python benchmarks/fuzz_decoders.py --atheris [--runs 200000] [--seconds 120]   # pip install 'fedweave[fuzz]'

The first form mutates valid encoded messages of every body (instruction, update,
evaluation, control, site job, site reply), control frames and JSON requests: truncation,
bit flips (with and without a recomputed metadata checksum), a metadata field replaced by
a hostile value (deep nesting, a list where a name belongs, 10**400, 1e400, negative or
huge shapes, non-ASCII digits) or swapped with another field, keys dropped, huge declared
sizes with a metadata that agrees with them, bytes inserted. Each input goes through
every decoder a peer's bytes reach: the whole-buffer decoder (read-only and writable, with
the configured size limit and expected shapes), the stream decoder in random chunks (no
size limit, so a declared 60 GiB reaches the allocation), the frame decoder, the control
frame and JSON parsers, and the node-id parser. Each must return or raise
:class:`~fedweave.errors.SerializationError`. The script prints how many inputs were
decoded, how many rejected, and how many raised anything else (with the first of each
kind); it exits with status 1 when that count is not 0.

The second form feeds the same decoders from libFuzzer's coverage-guided mutations of
the same seeds, for a bounded number of runs or seconds; a non-project exception is a
crash that libFuzzer reports with its input.
"""

from __future__ import annotations

import argparse
import collections
import copy
import inspect
import json
import random
import struct
import sys
import tempfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from fedweave.errors import SerializationError
from fedweave.transports import serialization as ser
from fedweave.transports.grpc import protocol as p
from fedweave.types import Control, Evaluation, Instruction, Message, TaskKind, Update, UpdateKind, Work

MAX_BYTES = 2048 << 20  # grpc.max_message_mb's default
PARAMS = {"w": torch.randn(3, 4), "b": torch.zeros(4), "n": torch.tensor([1, 2], dtype=torch.int64)}
EXPECTED = {k: tuple(v.shape) for k, v in PARAMS.items()}

HOSTILE: list[Any] = [
    None, True, -1, 0, 2**31, 2**63 - 1, -(2**63), 0.5, -0.0, "", "x", "²", "٥", "0", "params", [], {}, [0, 2**62],
    [2**62, 2**62], [-1], [0] * 70, [1, 2, 3], {"a": 1}, ["float32"], [["nested"]], "float32", "update", "site_reply",
]
"""Values a hostile peer writes into a metadata field (beside the raw-text ones of :func:`_raw_values`)."""

RAW_VALUES = ["1" + "0" * 400, "1e400", "-1e400", "NaN", "Infinity", "9" * 5000, "[" * 5000 + "]" * 5000,
              "{\"a\":" * 3000 + "1" + "}" * 3000, "18446744073709551616", "9223372036854775808"]
"""Hostile values only JSON text can hold (Python's json would not write them): huge numbers, deep nesting."""


# --------------------------------------------------------------------------- seeds


def messages() -> list[Message]:
    """One valid message of each body, as peers send them."""
    work = Work(client_id=1, batch_size=8, epochs=1, local_steps=3)
    instruction = Instruction(2, TaskKind.TRAIN, work, PARAMS, config={"lr": 0.1, "nested": {"k": [1, 2]}},
                              extras={"c": torch.ones(4)}, applied=[])
    update = Update(UpdateKind.DELTA, {k: v.clone() for k, v in PARAMS.items()}, num_examples=40,
                    metrics={"train_loss": 0.5}, extras={"dc": torch.zeros(2, dtype=torch.float64)},
                    client_id=1, local_steps=3, compute_time=0.25, clients=2, members=[1, 2])
    evaluation = Evaluation(num_examples=5, metrics={"accuracy": 0.5}, client_id=1)
    control = Control("secagg", "keys", {"pk": torch.arange(32, dtype=torch.uint8)})
    members = [Message(2, c, Instruction(2, TaskKind.TRAIN, Work(c, 8), PARAMS)) for c in (3, 4)]
    replies = [Message(2, 3, Update(UpdateKind.WEIGHTS, PARAMS, num_examples=7, client_id=3)),
               Message(2, 4, Evaluation(num_examples=2, metrics={}, client_id=4))]
    return [
        Message(2, 1, instruction),
        Message(2, 1, update),
        Message(2, 1, evaluation),
        Message(2, 1, control),
        Message(2, 0, ser.SiteJob(members, timeout=30.0)),
        Message(2, 0, ser.SiteReply(replies[:1], failures={4: "lost"})),
        Message(2, 0, ser.SiteReply(replies)),
        Message(2, 0, ser.SiteReply([], {3: "site group broken: gone", 4: "site group broken: gone"}, "gone")),
    ]


def control_frames() -> list[bytes]:
    data = next(ser.encode_frames(messages()[2]))
    return [
        p.control_frame({"type": "job", "job": "a1-1", "round": 2}, data),
        p.control_frame({"type": "idle"}),
        p.control_frame({"type": "error", "reason": "out of memory"}),
    ]


def requests() -> list[bytes]:
    return [p.encode_json({"version": p.VERSION}), p.encode_json({"session": "ab12", "heartbeat_interval": 1.0})]


# --------------------------------------------------------------------------- mutations


def split(data: bytes) -> tuple[tuple[Any, ...], bytes, bytes]:
    """(header fields, metadata, rest) of an encoded message."""
    fields = ser.HEADER.unpack_from(data)
    meta_len = fields[3]
    return fields, data[ser.HEADER.size : ser.HEADER.size + meta_len], data[ser.HEADER.size + meta_len :]


def join(fields: tuple[Any, ...], meta: bytes, rest: bytes, data_len: int | None = None) -> bytes:
    """A message of ``meta`` with a matching length and checksum (the rest re-padded to its data)."""
    magic, version, flags, old_len, _, old_data = fields
    data = rest[len(rest) - old_data :] if old_data <= len(rest) else rest
    head = ser.HEADER.pack(magic, version, flags, len(meta), zlib.crc32(meta), old_data if data_len is None else data_len)
    head += meta
    return head + bytes(ser.align(len(head)) - len(head)) + data


def hostile(rng: random.Random) -> Any:
    return copy.deepcopy(rng.choice(HOSTILE))


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every path (keys and indices) inside a JSON value."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield prefix + (k,)
            yield from paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield prefix + (i,)
            yield from paths(v, prefix + (i,))


def get(value: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        value = value[key]
    return value


def put(value: Any, path: tuple[Any, ...], new: Any) -> None:
    get(value, path[:-1])[path[-1]] = new


MARK = "\u0000fuzz-raw\u0000"


def dumps(meta: Any, raw: str | None) -> bytes:
    """``meta`` as JSON, the string ``MARK`` (when ``raw`` is given) replaced by raw JSON text."""
    text = json.dumps(meta, separators=(",", ":"))
    return (text if raw is None else text.replace(json.dumps(MARK), raw, 1)).encode()


def mutate_meta(rng: random.Random, data: bytes) -> bytes:
    fields, meta_bytes, rest = split(data)
    meta = json.loads(meta_bytes)
    where = list(paths(meta))
    how = rng.choice(["replace", "raw", "swap", "drop", "add", "sizes"])
    raw = None
    if how == "replace":
        put(meta, rng.choice(where), hostile(rng))
    elif how == "raw":
        put(meta, rng.choice(where), MARK)
        raw = rng.choice(RAW_VALUES)
    elif how == "swap":
        a, b = sorted((rng.choice(where), rng.choice(where)), key=len)
        if b[: len(a)] == a:  # one inside the other
            put(meta, a, hostile(rng))
        else:
            va, vb = get(meta, a), get(meta, b)
            put(meta, a, vb)
            put(meta, b, va)
    elif how == "drop":
        dicts = [path for path in where if isinstance(get(meta, path), dict)] or [()]
        target = get(meta, rng.choice(dicts))
        if isinstance(target, dict) and target:
            del target[rng.choice(list(target))]
    elif how == "add":
        dicts = [path for path in where if isinstance(get(meta, path), dict)] or [()]
        target = get(meta, rng.choice(dicts))
        if isinstance(target, dict):
            target[rng.choice(["x", "²", "٥", "5", "round"])] = hostile(rng)
    else:  # a tensor that declares a huge size, and a header that agrees
        if meta["tensors"]:
            entry = rng.choice(meta["tensors"])
            numel = rng.choice([15 << 30, 1 << 40, 1 << 61, (1 << 62) - 1])
            entry[3], entry[5] = [numel], numel * torch.empty((), dtype=ser.DTYPES[entry[2]]).element_size()
            ends = [e[4] + e[5] for e in meta["tensors"]]
            return join(fields, dumps(meta, None), rest, data_len=min(max(ends), (1 << 64) - 1))
    return join(fields, dumps(meta, raw), rest)


def flip(rng: random.Random, data: bytes, lo: int = 0, hi: int | None = None) -> bytes:
    out = bytearray(data)
    hi = len(out) if hi is None else min(hi, len(out))
    for _ in range(rng.randint(1, 8)):
        if hi > lo:
            out[rng.randrange(lo, hi)] ^= 1 << rng.randrange(8)
    return bytes(out)


def mutate_message(rng: random.Random, data: bytes) -> bytes:
    how = rng.random()
    if how < 0.45:
        return mutate_meta(rng, data)
    if how < 0.55:
        return data[: rng.randrange(len(data))]
    if how < 0.65:
        return flip(rng, data)
    if how < 0.75:  # bits of the metadata, its checksum recomputed
        fields, meta, rest = split(data)
        return join(fields, flip(rng, meta), rest)
    if how < 0.85:  # the header's sizes
        fields = list(ser.HEADER.unpack_from(data))
        index = rng.choice([3, 5])  # meta_len u32, data_len u64
        top = (1 << 32) - 1 if index == 3 else (1 << 64) - 1
        fields[index] = min(rng.choice([0, 1, len(data), 60 << 30, top]), top)
        return ser.HEADER.pack(*fields) + data[ser.HEADER.size :]
    if how < 0.95:
        at = rng.randrange(len(data) + 1)
        return data[:at] + rng.randbytes(rng.randint(1, 64)) + data[at:]
    return rng.randbytes(rng.randint(0, 200))


def mutate_control(rng: random.Random, frame: bytes) -> bytes:
    how = rng.random()
    if how < 0.4:
        text = dumps({"type": "job", "job": MARK}, rng.choice([*RAW_VALUES, "[1]", "{}", "\"x\""]))
        return p.FRAME.pack(p.CONTROL, 0, 0, 0, 0, 0) + text
    if how < 0.7:
        return flip(rng, frame)
    if how < 0.85:  # the inline length field
        out = bytearray(frame)
        out[4:8] = struct.pack("<I", rng.choice([0, len(frame), 1 << 31, (1 << 32) - 1]))
        out[1] |= p.INLINE
        return bytes(out)
    return frame[: rng.randrange(len(frame))]


def mutate_request(rng: random.Random, data: bytes) -> bytes:
    if rng.random() < 0.6:
        return dumps({"version": MARK}, rng.choice([*RAW_VALUES, "[]", "2"]))
    return flip(rng, data)


# --------------------------------------------------------------------------- decoders


Decoder = Callable[[], object]


def message_decoders(data: bytes, rng: random.Random) -> list[Decoder]:
    """``data`` through every message decoder a peer's bytes reach."""
    return [
        lambda: ser.decode(data, max_bytes=MAX_BYTES),
        lambda: ser.decode(bytearray(data), max_bytes=MAX_BYTES, expected=EXPECTED),
        lambda: stream(data, rng),
        lambda: frames(data, rng),
    ]


def stream(data: bytes, rng: random.Random) -> Message:
    decoder = ser.StreamDecoder(expected=EXPECTED)  # no size limit: a declared size reaches the allocation
    at = 0
    while at < len(data):
        step = rng.randint(1, 4096)
        decoder.feed(data[at : at + step])
        at += step
    return decoder.finish()


def frames(data: bytes, rng: random.Random) -> Message:
    decoder = ser.FrameDecoder(max_chunk_bytes=4096, max_bytes=MAX_BYTES, require_checksum=True)
    step = rng.randint(64, 4096)
    for seq, at in enumerate(range(0, len(data), step)):
        chunk = data[at : at + step]
        frame = ser.FRAME.pack(ser.DATA, ser.FLAG_CRC, 0, seq, ser.chunk_crc32(chunk), at) + chunk
        decoder.feed(flip(rng, frame) if rng.random() < 0.02 else frame)
    return decoder.finish()


def control_decoders(frame: bytes) -> list[Decoder]:
    return [lambda: p.parse_control(frame), lambda: p.inline_frame(frame)]


def inputs(count: int, seed: int) -> Iterator[tuple[str, list[Decoder]]]:
    """``count`` fuzzed inputs: what each is, and the decoders it goes through."""
    rng = random.Random(seed)
    encoded = [bytes(ser.encode(m)) for m in messages()]
    controls, plain = control_frames(), requests()
    for _ in range(count):
        what = rng.random()
        if what < 0.8:
            yield "message", message_decoders(mutate_message(rng, rng.choice(encoded)), rng)
        elif what < 0.9:
            yield "control frame", control_decoders(mutate_control(rng, rng.choice(controls)))
        elif what < 0.97:
            data = mutate_request(rng, rng.choice(plain))
            yield "request", [lambda data=data: p.decode_json(data)]
        else:
            text = rng.choice(["5", "٥", "²", "05", "-1", "1" * 30, "", " 5", "5\n", "0x5"])
            yield "node id", [lambda text=text: ser.ascii_id(text)]


def run(count: int, seed: int) -> tuple[collections.Counter[str], dict[str, str]]:
    """Counts of decoder outcomes ("decoded", "rejected", each other exception's type), with
    "inputs with another exception" among them, and the first message of each other kind."""
    outcomes: collections.Counter[str] = collections.Counter()
    first: dict[str, str] = {}
    for what, decoders in inputs(count, seed):
        bad = False
        for call in decoders:
            try:
                call()
                outcomes["decoded"] += 1
            except SerializationError:
                outcomes["rejected"] += 1
            except Exception as exc:  # noqa: BLE001 - what this script counts
                kind = f"{type(exc).__name__} ({what})"
                outcomes[kind] += 1
                first.setdefault(kind, str(exc)[:160])
                bad = True
        outcomes["inputs with another exception"] += bad
    return outcomes, first


# --------------------------------------------------------------------------- atheris


def atheris_input(data: bytes) -> None:
    """One libFuzzer input: its first byte picks the decoder; a message's metadata checksum is
    recomputed (else nearly every mutation would stop there). Only SerializationError may escape
    a decoder; anything else is the crash libFuzzer reports."""
    if not data:
        return
    body = data[1:]
    target = data[0] % 3
    if target == 0:
        if len(body) >= ser.HEADER.size and body[:4] == ser.MAGIC:
            fields, meta, rest = split(body)
            body = join(fields, meta, rest) if len(meta) == fields[3] else body
        decoders = message_decoders(body, random.Random(len(body)))
    else:
        decoders = control_decoders(body) if target == 1 else [lambda: p.decode_json(body)]
    for call in decoders:
        try:
            call()
        except SerializationError:
            pass


def fuzz_atheris(runs: int, seconds: int) -> None:
    try:
        import atheris
    except ImportError:
        raise SystemExit("--atheris needs atheris: pip install 'fedweave[fuzz]'") from None
    seeds = Path(tempfile.mkdtemp(prefix="fedweave-fuzz-"))
    corpus = [b"\0" + bytes(ser.encode(m)) for m in messages()]
    corpus += [b"\1" + f for f in control_frames()] + [b"\2" + r for r in requests()]
    for i, seed in enumerate(corpus):
        (seeds / f"seed-{i}").write_bytes(seed)
    for module in (ser, p):  # already imported: instrument their functions and methods in place
        for value in vars(module).values():
            if getattr(value, "__module__", None) != module.__name__:
                continue
            functions = vars(value).values() if inspect.isclass(value) else [value]
            for function in functions:
                if inspect.isfunction(function):
                    atheris.instrument_func(function)
    args = [sys.argv[0], f"-runs={runs}", f"-max_total_time={seconds}", "-rss_limit_mb=4096", str(seeds)]
    atheris.Setup(args, atheris_input)
    atheris.Fuzz()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=10_000, help="fuzzed inputs (default 10,000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--atheris", action="store_true", help="a coverage-guided run instead")
    parser.add_argument("--runs", type=int, default=200_000, help="atheris: most inputs")
    parser.add_argument("--seconds", type=int, default=120, help="atheris: most seconds")
    args = parser.parse_args()
    if args.atheris:
        fuzz_atheris(args.runs, args.seconds)
        return 0
    outcomes, first = run(args.count, args.seed)
    bad = outcomes["inputs with another exception"]
    print(f"{args.count} fuzzed inputs (seed {args.seed}), {sum(outcomes.values()) - bad} decoder calls: "
          f"{outcomes['decoded']} decoded, {outcomes['rejected']} rejected with SerializationError, "
          f"{sum(outcomes[k] for k in first)} raised another exception")
    print(f"inputs with a non-project exception: {bad}")
    for kind in sorted(first):
        print(f"  {outcomes[kind]:6d}  {kind}: {first[kind]}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
