"""How plugins lay compact representations out as ``dict[str, Tensor]`` payloads.

An encoded payload stays a mapping of names to tensors, so every transport carries it
and the loop counts its real wire bytes (:func:`fedweave.types.body_nbytes`). A tensor
``name`` that a plugin replaces is stored as fields ``name.__<field>`` (for example
``fc.weight.__values`` and ``fc.weight.__indices``) plus ``name.__layout``: its dtype
and shape, so the receiver rebuilds it without knowing the model. Tensors of the
payload that are not floating point (``num_batches_tracked`` and other counters) are
never transformed: they travel as they are.

A plugin that works on the whole update at once (secure aggregation, HE) flattens the
floating tensors into one vector with :func:`flatten` (their layouts become
``name.__flat``) and rebuilds them with :func:`unflatten`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from fedweave.types import Params

if TYPE_CHECKING:
    from fedweave.federated.checks import Specs

SEP = ".__"
LAYOUT = "layout"
FLAT = "flat"  # the layout of a tensor inside a flattened vector (kept apart from a codec's layouts)

_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def field(name: str, part: str) -> str:
    """The payload key of field ``part`` of tensor ``name``."""
    return f"{name}{SEP}{part}"


def layout(tensor: torch.Tensor) -> torch.Tensor:
    """``[dtype code, *shape]`` as a small int32 tensor (4 bytes per entry on the wire). One
    tensor per dtype and shape, shared by the payloads that carry it (never written to)."""
    return _layout(tensor.dtype, tuple(tensor.shape))


@functools.lru_cache(maxsize=1024)
def _layout(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor([_DTYPES.index(dtype), *shape], dtype=torch.int32)


MAX_DIMS = 64
"""The most dimensions a tensor has (torch's limit): a layout holds at most 1 + this many integers."""


def read_layout(value: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...]]:
    integer = not (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool)
    if not integer or value.dim() != 1 or not 1 <= value.numel() <= 1 + MAX_DIMS:
        raise ValueError(f"a layout is 1 to {1 + MAX_DIMS} integers, not {value.dtype} of shape {tuple(value.shape)}")
    code, *shape = (int(v) for v in value.tolist())
    if not 0 <= code < len(_DTYPES):
        raise ValueError(f"layout names dtype code {code}, not one of 0..{len(_DTYPES) - 1}")
    if any(s < 0 for s in shape):
        raise ValueError(f"layout names shape {tuple(shape)}, with a negative size")
    return _DTYPES[code], tuple(shape)


def group(tensors: Params) -> tuple[dict[str, dict[str, torch.Tensor]], Params]:
    """Split a payload into encoded tensors (name -> their fields) and plain ones, in order."""
    encoded: dict[str, dict[str, torch.Tensor]] = {}
    plain: Params = {}
    for key, value in tensors.items():
        name, sep, part = key.rpartition(SEP)
        if sep:
            encoded.setdefault(name, {})[part] = value
        else:
            plain[key] = value
    return encoded, plain


def encode_fields(tensors: Params, fields: Mapping[str, dict[str, torch.Tensor] | None]) -> Params:
    """``tensors`` with each tensor that ``fields`` maps to fields replaced by them (and its
    layout), in order; the others (not named, or None) as they are."""
    out: Params = {}
    for name, tensor in tensors.items():
        parts = fields.get(name)
        if parts is None:
            out[name] = tensor
            continue
        out[field(name, LAYOUT)] = layout(tensor)
        for part, value in parts.items():
            out[field(name, part)] = value
    return out


def decode_all(
    tensors: Params,
    decompress: Callable[[list[str], list[dict[str, torch.Tensor]], list[tuple[int, ...]]], list[torch.Tensor]],
    expected: Specs | None = None,
) -> Params:
    """Undo :func:`encode_fields`: rebuild every encoded tensor (in its dtype and shape),
    all with one call (names, their fields, their shapes -> the float tensors, in that
    order). With
    ``expected`` (what the decoded payload may hold), every layout is checked against it
    (:func:`check_layouts`) before anything is decompressed."""
    encoded, _ = group(tensors)
    for name, fields in encoded.items():
        if LAYOUT not in fields:
            raise ValueError(f"encoded tensor {name!r} has no layout")
    layouts = {name: read_layout(fields.pop(LAYOUT)) for name, fields in encoded.items()}
    if expected is not None:
        check_layouts(layouts, expected)
    names = list(encoded)
    rebuilt = decompress(names, [encoded[n] for n in names], [layouts[n][1] for n in names])
    if len(rebuilt) != len(names):
        raise ValueError(f"{len(names)} encoded tensors, {len(rebuilt)} rebuilt")
    decoded = dict(zip(names, rebuilt))
    out: Params = {}
    for key, value in tensors.items():
        name, sep, _ = key.rpartition(SEP)
        if not sep:
            out[key] = value
        elif name in decoded:
            dtype, shape = layouts[name]
            tensor = decoded.pop(name)  # reshaped and cast only where it is not already (a call costs µs)
            tensor = tensor if tensor.shape == shape else tensor.reshape(shape)
            out[name] = tensor if tensor.dtype == dtype else tensor.to(dtype)
    return out


def clear_layouts(tensors: Params) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The layouts of model tensors an encoded-sum payload carries in the clear (a codec's, or a
    tensor's place in the flattened vector), by tensor name. The place of a codec's field in the
    vector (``w.__values.__flat``) describes no model tensor and is left to the codec's decoder."""
    out = {}
    for key, value in tensors.items():
        name, _, part = key.rpartition(SEP)
        if part == LAYOUT or (part == FLAT and SEP not in name):
            out[name] = read_layout(value)
    return out


def check_layouts(layouts: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], expected: Specs) -> None:
    """Raise ``ValueError`` unless each layout (name -> dtype, shape) is that of the tensor of
    ``expected`` it names, so a peer's layout cannot make the receiver build a tensor other
    than, or larger than, the model's."""
    for name, (dtype, shape) in layouts.items():
        spec = expected.get(name)
        if spec is None:
            raise ValueError(f"the payload encodes {name!r}, which is not a tensor of the model")
        if (dtype, shape) != (spec.dtype, spec.shape):
            raise ValueError(f"the layout of {name!r} is {dtype} {shape}, the model's {spec.dtype} {spec.shape}")


def flatten(tensors: Params, out: Any = None) -> tuple[torch.Tensor, Params]:
    """All floating tensors as one float64 vector, and the rest: each floating tensor's
    layout (``name.__flat``) and the non-floating tensors, in their order. With ``out`` (a
    numpy or torch vector of any real dtype and the right size), the floating tensors are
    written into it instead, and the vector returned shares its memory."""
    parts = []
    rest: Params = {}
    for name, tensor in tensors.items():
        if tensor.is_floating_point():
            parts.append(tensor.detach().reshape(-1))
            rest[field(name, FLAT)] = layout(tensor)
        else:
            rest[name] = tensor
    size = sum(p.numel() for p in parts)
    vector = torch.empty(size, dtype=torch.float64) if out is None else torch.as_tensor(out)
    if vector.dim() != 1 or vector.numel() != size:
        raise ValueError(f"flatten: out has shape {tuple(vector.shape)}, the floating tensors hold {size} values")
    if parts:
        torch.cat(parts, out=vector)  # one pass, converting to out's dtype
    return vector, rest


def unflatten(vector: torch.Tensor, rest: Params) -> Params:
    """Undo :func:`flatten`."""
    out: Params = {}
    offset = 0
    for key, value in rest.items():
        name, sep, part = key.rpartition(SEP)
        if not sep or part != FLAT:
            out[key] = value
            continue
        dtype, shape = read_layout(value)
        size = 1
        for s in shape:
            size *= s
        out[name] = vector[offset : offset + size].reshape(shape).to(dtype)
        offset += size
    if offset != vector.numel():
        raise ValueError(f"payload holds {vector.numel()} values, its layout {offset}")
    return out


def combine_plain(payloads: list[Params]) -> Params:
    """Combine the tensors that travel in the clear in encoded-sum plugins: layouts must
    agree; other (integer) tensors are counters (or a codec's seeds, equal across
    clients) and take the element-wise maximum, as
    :func:`fedweave.strategies.aggregate.weighted_average` does."""
    out: Params = {}
    for key, first in payloads[0].items():
        if key.endswith((SEP + LAYOUT, SEP + FLAT)):
            for p in payloads[1:]:
                if not torch.equal(p[key], first):
                    raise ValueError(f"clients disagree on the layout of {key.rpartition(SEP)[0]!r}")
            out[key] = first
            continue
        acc = first.clone()
        for p in payloads[1:]:
            acc = torch.maximum(acc, p[key])
        out[key] = acc
    return out
