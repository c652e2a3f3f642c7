"""SecAgg's control messages: the names of its steps and tensors, and their bodies, built and checked."""

from __future__ import annotations

import numpy as np
import torch

from fedweave.types import Control

MASKED = "__secagg_masked"
SUM = "__secagg_sum"

ADVERTISE, SHARE, FORWARD, UNMASK = "advertise", "share", "forward", "unmask"
MASKED_STEP = "masked"  # a client's state once it sent y_u (not a message)


def u8(rows: list[bytes], width: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(b"".join(rows)), dtype=torch.uint8).reshape(len(rows), width)


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
