"""QSGD and int8 quantization written out from their definitions, one tensor at a time:
what the codecs' one-matrix encodings must equal bit for bit; and what the codecs' tests
share (bit-for-bit comparison, sites, test tensors, a reshaped field's refusal)."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from fedweave.plugins.contracts import PluginContext
from fedweave.plugins.compression.wire import Site
from fedweave.federated.checks import UpdateSchema

from ..helpers import ctx, update

SHAPES = [(37, 11), (100,), (6, 9), (1,), (2, 3, 5)]
"""The shapes of the tensors :func:`tensors` makes for the codecs' tests: several buckets,
one entry, a transposable matrix."""


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same dtype, shape and bits (0.0 and -0.0 differ, a NaN equals itself)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        width = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a, b = a.view(width), b.view(width)
    return torch.equal(a, b)


def site(name: str, client: int = 3, rnd: int = 5) -> Site:
    return Site("test", 11, "up", rnd, client, name)


def noise(where: Site, rows: int, size: int) -> torch.Tensor:
    """The draws a tensor's buckets get: torch.rand from the site's own generator."""
    return torch.rand((rows, size), generator=where.generator(where.client_id, where.name))


def padded_rows(x: torch.Tensor, size: int) -> torch.Tensor:
    """``x``'s entries as rows of ``size``, the last one zero-padded."""
    flat = x.reshape(-1)
    rows = torch.zeros(-(-flat.numel() // size), size)
    rows.view(-1)[: flat.numel()] = flat
    return rows


def qsgd(x: torch.Tensor, s: int, size: int, where: Site) -> tuple[torch.Tensor, torch.Tensor]:
    """Signed float levels and per-bucket norms: |v| / ‖bucket‖ · s rounded up where the
    bucket's draw is below its fractional part, with v's sign."""
    magnitudes = padded_rows(x, size).abs()
    norms = torch.linalg.vector_norm(magnitudes, dim=1, keepdim=True)
    scaled = magnitudes / torch.where(norms > 0, norms, torch.ones_like(norms)) * s
    lower = torch.floor(scaled)
    levels = lower + (noise(where, *scaled.shape) < scaled - lower).to(torch.float32)
    return torch.copysign(levels.view(-1)[: x.numel()], x.reshape(-1)), norms.view(-1)


def qsgd_decoded(levels: torch.Tensor, norms: torch.Tensor, s: int, size: int) -> torch.Tensor:
    """level · norm / s, entry by entry, with its bucket's norm (levels as the integers
    they travel as)."""
    per_entry = norms.repeat_interleave(size)[: levels.numel()]
    return levels.to(torch.int32).to(torch.float32) * per_entry / s


def nibbles(levels: torch.Tensor) -> torch.Tensor:
    """Signed levels in [-7, 7] offset by 8, two per byte (the first in the high half)."""
    codes = [int(v) + 8 for v in levels]
    codes += [8] * (len(codes) % 2)
    return torch.tensor([(a << 4) | b for a, b in zip(codes[0::2], codes[1::2])], dtype=torch.uint8)


def int8(x: torch.Tensor, size: int, where: Site | None) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values and per-bucket scales: each bucket over its largest magnitude / 127,
    rounded down or up at random (``where`` the site) or to the nearest, within ±127."""
    rows = padded_rows(x, size)
    scales = rows.abs().amax(dim=1, keepdim=True) / 127
    scaled = rows / torch.where(scales > 0, scales, torch.ones_like(scales))
    if where is None:
        rounded = torch.round(scaled)
    else:
        lower = torch.floor(scaled)
        rounded = lower + (noise(where, *scaled.shape) < scaled - lower).to(torch.float32)
    return rounded.clamp(-127, 127).to(torch.int8).view(-1)[: x.numel()], scales.view(-1)


def int8_decoded(values: torch.Tensor, scales: torch.Tensor, size: int) -> torch.Tensor:
    return values.to(torch.float32) * scales.repeat_interleave(size)[: values.numel()]


def tensors(seed: int, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """Random tensors of ``shapes`` at several scales, one with a run of zeros (a zero
    bucket for small buckets), one of -0.0 entries, and one transposed (not contiguous)."""
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(shape, generator=g) * 10.0 ** float(torch.randint(-3, 3, (), generator=g)) for shape in shapes]
    xs[0].view(-1)[: xs[0].numel() // 2] = 0.0
    if len(xs) > 1:
        xs[1].view(-1)[::3] = -0.0
    if len(xs) > 2 and xs[2].dim() == 2:
        xs[2] = xs[2].t()
    return xs


def straddling_noise(scaled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two draws for each entry of ``scaled`` that decide its rounding by the last bit of
    its fractional part: the fraction itself (not below it: round down) and the float just
    under it (below it, where it is positive: round up). A rounding one ulp away from the
    definition's, anywhere, moves a level."""
    frac = scaled - torch.floor(scaled)
    below = torch.where(frac > 0, torch.nextafter(frac, torch.zeros_like(frac)), frac)
    return frac, below


def refuses_reshaped_field(plugin: Any, model: dict[str, torch.Tensor], name: str, part: str, shape: tuple) -> None:
    """``plugin``'s encoding of ``model`` decodes on a server as sent, and is refused, naming
    the field, once field ``part`` of tensor ``name`` is reshaped to ``shape`` (its size kept)."""
    encoded = plugin.encode(update(model), ctx()).tensors
    server = PluginContext(1, 0, "server", expected=UpdateSchema.of(model).tensors)
    plugin.decode(update(encoded), server)  # as sent: decodes
    key = f"{name}.__{part}"
    forged = {**encoded, key: encoded[key].reshape(shape)}
    reason = f"fields of {name!r} {tuple(model[name].shape)}: {part!r} is of shape {tuple(forged[key].shape)}, not a vector"
    with pytest.raises(ValueError, match=re.escape(reason)):
        plugin.decode(update(forged), server)
