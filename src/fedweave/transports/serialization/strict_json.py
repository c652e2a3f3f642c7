"""Strict reading of a peer's JSON, and checks of what a peer writes."""

from __future__ import annotations

import json
import math
from typing import Any

from fedweave.errors import SerializationError
from fedweave.transports.serialization.format import MAX_INT


def check(ok: bool, what: str) -> None:
    if not ok:
        raise SerializationError(f"malformed message metadata: {what}")


def _json_int(text: str) -> int:
    # at most 19 digits and a sign: int() never sees a huge literal, and the value fits int64
    check(len(text.lstrip("-")) <= 19 and abs(int(text)) <= MAX_INT, f"integer {text[:30]} is out of range")
    return int(text)


def _json_float(text: str) -> float:
    value = float(text)
    check(math.isfinite(value), f"number {text[:30]} is out of range")
    return value


def _json_constant(text: str) -> float:
    raise SerializationError(f"malformed message metadata: {text} is not a number JSON allows")


def load_json(data: bytes | memoryview, what: str) -> Any:
    """Strict JSON of a peer: UTF-8, integers within int64, finite floats (no NaN or Infinity),
    nesting within the interpreter's recursion limit; anything else is a SerializationError."""
    try:
        return json.loads(
            bytes(data).decode("utf-8"),
            parse_int=_json_int,
            parse_float=_json_float,
            parse_constant=_json_constant,
        )
    except RecursionError:
        raise SerializationError(f"malformed {what}: JSON nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise SerializationError(f"malformed {what}: not UTF-8 JSON ({exc})") from None


def ascii_id(text: Any) -> int | None:
    """A node id written by a peer: ASCII digits only (not "²" or "٥"), within int64; else None."""
    if not isinstance(text, str) or not 0 < len(text) <= 18 or not text.isascii() or not text.isdigit():
        return None
    return int(text)
