"""SecAgg's control messages on the wire: every step's bodies cross the wire format unchanged,
and malformed control metadata is refused there."""

from __future__ import annotations

import json
import zlib
from typing import Any

import pytest
import torch

from fedweave.errors import SerializationError
from fedweave.transports import serialization as ser
from fedweave.types import Control, Message

from ...helpers import ctx, make, model_tensors, update
from .rounds import Federation, assert_mean_within_quantization


def test_every_step_crosses_the_wire_format_unchanged() -> None:
    """Control bodies (and the masked updates) survive :mod:`fedweave.transports.serialization`."""
    plugin = make("secagg", clients=4)
    fed = Federation(plugin)

    def wire(body: Any) -> Any:
        return ser.decode(ser.encode(Message(1, 0, body))).body

    def exchange(bodies: dict[int, Control]) -> dict[int, Control]:
        return {u: wire(a) for u, a in fed.exchange({u: wire(b) for u, b in bodies.items()}).items()}

    assert plugin.setup(1, [0, 1, 2, 3], exchange) == [0, 1, 2, 3]
    plain = [update(model_tensors(i, scale=0.5), num_examples=5 + i, client_id=i) for i in range(4)]
    masked = [wire(plugin.encode(u, fed.ctx(u.client_id))) for u in plain]
    server = ctx(1, -1, "server")
    result = plugin.decode(plugin.combine(masked, server, exchange), server).tensors
    assert_mean_within_quantization(result, plain, plugin)


def control_metadata(**changes: Any) -> bytes:
    """An encoded control message whose metadata fields are changed, with a correct checksum."""
    buf = ser.encode(Message(1, 0, Control("secagg", "share", {"cohort": torch.tensor([0, 1], dtype=torch.int32)})))
    _, _, _, meta_len, _, data_len = ser.HEADER.unpack_from(buf)
    meta = json.loads(bytes(buf[ser.HEADER.size : ser.HEADER.size + meta_len]))
    meta["fields"].update(changes)
    data = bytes(buf[len(buf) - data_len :])
    raw = json.dumps(meta).encode()
    head = ser.HEADER.pack(ser.MAGIC, ser.VERSION, 0, len(raw), zlib.crc32(raw), len(data)) + raw
    return head + bytes(-len(head) % ser.ALIGN) + data


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        ({"plugin": ""}, "control plugin '' is not a name"),
        ({"step": "a b"}, "control step 'a b' is not a name"),
        ({"step": 7}, "control step 7 is not a name"),
        ({"plugin": "x" * 101}, "is not a name"),
        ({"extra": 1}, r"control fields are not \['plugin', 'step'\]"),
    ],
)
def test_malformed_control_metadata_is_refused_by_the_wire_format(changes: dict[str, Any], error: str) -> None:
    assert ser.decode(control_metadata()).body.step == "share"  # the unchanged message decodes
    with pytest.raises(SerializationError, match=error):
        ser.decode(control_metadata(**changes))
