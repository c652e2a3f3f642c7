"""SecAgg's control messages: the names of its steps and tensors, and their bodies, built and checked."""

from __future__ import annotations

import numpy as np
import torch

from fedweave.plugins.secure import pedersen
from fedweave.types import Control

MASKED = "__secagg_masked"
SUM = "__secagg_sum"

ADVERTISE, SHARE, FORWARD, UNMASK = "advertise", "share", "forward", "unmask"
MASKING = "secagg.masking"
"""The key of a training instruction's ``config`` that tells a client whom it masks with."""
MASKED_STEP = "masked"  # a client's state once it sent y_u (not a message)


def u8(rows: list[bytes], width: int) -> torch.Tensor:
    if not rows:
        return torch.zeros((0, width), dtype=torch.uint8)
    return torch.frombuffer(bytearray(b"".join(rows)), dtype=torch.uint8).reshape(len(rows), width)


def share_bytes(shares: list[tuple[int, int]]) -> bytes:
    """Shares (value, blinding) in GF(Q) as big-endian scalars, one after the other."""
    return b"".join(v.to_bytes(pedersen.SCALAR_BYTES, "big") for share in shares for v in share)


def read_shares(data: bytes) -> list[tuple[int, int]]:
    """Undo :func:`share_bytes`; ValueError for a value outside GF(Q)."""
    n = pedersen.SCALAR_BYTES
    values = [int.from_bytes(data[i : i + n], "big") for i in range(0, len(data), n)]
    if any(v >= pedersen.Q for v in values):
        raise ValueError("a share is not an element of GF(Q)")
    return list(zip(values[::2], values[1::2]))


def commitments(rows: list[list[int]]) -> torch.Tensor:
    """A dealer's commitments (one row per secret) as a uint8 tensor (secrets, threshold, element bytes)."""
    data = b"".join(c.to_bytes(pedersen.ELEMENT_BYTES, "big") for row in rows for c in row)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).reshape(len(rows), -1, pedersen.ELEMENT_BYTES)


def read_commitments(array: np.ndarray) -> list[list[int]]:
    """Undo :func:`commitments` (an array of shape (secrets, threshold, element bytes)); ValueError for a
    value that is not an element of the group."""
    return [[pedersen.to_element(bytes(c)) for c in row] for row in array]


def ids(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def body_tensor(control: Control, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """``control``'s tensor ``name`` as an array, checked: a ValueError names what is wrong."""
    t = control.tensors.get(name)
    if t is None or t.dtype != dtype or tuple(t.shape) != shape:
        got = "nothing" if t is None else f"{t.dtype} {tuple(t.shape)}"
        raise ValueError(f"secagg {control.step}: expected {name} of {dtype} {shape}, got {got}")
    return t.numpy()


def id_list(control: Control, name: str, allowed: tuple[int, ...] | list[int] | None = None) -> list[int]:
    """``control``'s tensor ``name``: a sorted list of distinct client ids (each in ``allowed``, if given)."""
    t = control.tensors.get(name)
    if t is None or t.dtype != torch.int32 or t.dim() != 1:
        raise ValueError(f"secagg {control.step}: expected {name} as a 1-d int32 tensor")
    ids = t.tolist()
    if ids != sorted(set(ids)) or (allowed is not None and not set(ids) <= set(allowed)):
        raise ValueError(f"secagg {control.step}: {name} is not a sorted list of distinct expected client ids")
    return ids
