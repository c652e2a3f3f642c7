"""The wire format's constants and the shape of what a receiver expects (its site batch bodies are
:class:`~fedweave.types.SiteJob` and :class:`~fedweave.types.SiteReply`)."""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence

import torch

MAGIC = b"FWMS"
VERSION = 4
"""2: updates name the clients behind them (``members``); site-job, site-reply and control bodies.
3: a site reply says whether its site's group is broken (``broken``).
4: secagg's control steps carry Pedersen commitments, shares in GF(Q) and the senders a client refused,
its training instructions whom a client masks with; he has a ``check`` step (a client's verdict)."""
HEADER = struct.Struct("<4sHHIIQ")
ALIGN = 64
CHUNK_BYTES = 1 << 20
MAX_META_BYTES = 64 << 20
MAX_INT = (1 << 63) - 1
"""The largest integer metadata may hold (int64): every count, id, shape and size fits a C long."""
MAX_NDIM = 64
MAX_ELEMENTS = 1 << 62
"""The most elements a tensor's shape may span, zero dimensions counted as one (strides fit int64)."""

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
    "bool": torch.bool,
}

# The tensor groups of each body, the first being the one checked against ``expected``.
GROUPS = {
    "instruction": ("params", "extras"),
    "update": ("tensors", "extras"),
    "evaluation": (),
    "control": ("tensors",),
}
BATCHES = {"site_job": ("instruction", "control"), "site_reply": ("update", "evaluation", "control")}
"""Site batch bodies and the inner bodies each may hold; their tensors are one ``pool`` group."""
GROUPS.update(dict.fromkeys(BATCHES, ("pool",)))

Expected = Mapping[str, Sequence[int]]
"""Tensor name -> shape a receiver expects (a sent update may carry a subset)."""


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


