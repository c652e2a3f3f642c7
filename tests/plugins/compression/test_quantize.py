"""int8 quantization's one-matrix encoding of a whole update against the definition,
tensor by tensor: the same values, scales and decoded floats bit for bit, stochastic and
nearest rounding, for several shapes, bucket sizes that do not divide them, and zeros."""

from __future__ import annotations

import pytest
import torch

from fedweave.plugins.compression.quantize import QuantizeCodec, QuantizeHParams, int8_values

from . import reference as ref
from .reference import SHAPES, same


@pytest.mark.parametrize("stochastic", [True, False])
@pytest.mark.parametrize("size", [1, 7, 64, 512])
def test_values_scales_and_decoded_floats_are_the_definitions(stochastic: bool, size: int) -> None:
    xs = ref.tensors(size + stochastic, SHAPES)
    codec = QuantizeCodec(QuantizeHParams(dtype="int8", bucket=size, stochastic=stochastic))
    sites = [ref.site(f"t{i}") for i in range(len(xs))]
    fields = codec.compress_many(xs, sites)
    expected = []
    for x, f, where in zip(xs, fields, sites):
        values, scales = ref.int8(x, size, where if stochastic else None)
        assert f.keys() == {"values", "scales"}
        assert same(f["values"], values) and same(f["scales"], scales)
        alone = codec.compress(x, where)
        assert same(alone["values"], values) and same(alone["scales"], scales)
        expected.append(ref.int8_decoded(values, scales, size))
    shapes = [tuple(x.shape) for x in xs]
    copied = [{k: v.clone() for k, v in f.items()} for f in fields]
    for parts, layout, want in ((fields, shapes, expected), (copied, shapes, expected),
                                (fields[::-1], shapes[::-1], expected[::-1])):
        out = codec.decompress_many(parts, layout)
        assert [tuple(t.shape) for t in out] == layout
        assert all(same(got.reshape(-1), w) for got, w in zip(out, want))


def test_values_are_entry_over_scale_in_one_rounding_to_the_last_bit() -> None:
    g = torch.Generator().manual_seed(4)
    rows = torch.randn(64, 33, generator=g) * torch.logspace(-6, 6, 64).view(-1, 1)
    rows[5] = 0.0
    scales = rows.abs().amax(dim=1, keepdim=True) / 127
    scaled = rows / torch.where(scales > 0, scales, torch.ones_like(scales))
    for noise, up in zip(ref.straddling_noise(scaled), (False, True)):
        want = torch.floor(scaled) + (up & (scaled > torch.floor(scaled)))
        assert same(int8_values(rows.clone(), scales, noise.clone()), want.clamp(-127, 127).to(torch.int8))
    assert same(int8_values(rows.clone(), scales, None), torch.round(scaled).clamp(-127, 127).to(torch.int8))


def test_a_zero_bucket_has_scale_zero_and_decodes_to_zero() -> None:
    x = torch.tensor([0.0, -0.0, 0.0, 0.0, 1.27, -0.5])
    codec = QuantizeCodec(QuantizeHParams(dtype="int8", bucket=4))
    (f,) = codec.compress_many([x], [ref.site("w")])
    assert same(f["scales"], torch.tensor([0.0, 0.01]))
    assert same(f["values"][:4], torch.zeros(4, dtype=torch.int8)) and int(f["values"][4]) == 127
    assert same(codec.decompress_many([f], [(6,)])[0][:4], torch.zeros(4))


def test_casts_decode_to_float32_values_of_the_cast() -> None:
    x = torch.tensor([1.0 / 3.0, -70000.0, 1e-8])
    for dtype, cast in (("float16", torch.float16), ("bfloat16", torch.bfloat16)):
        codec = QuantizeCodec(QuantizeHParams(dtype=dtype))
        (f,) = codec.compress_many([x], [ref.site("w")])
        assert same(f["values"], x.to(cast))
        assert same(codec.decompress_many([f], [(3,)])[0], x.to(cast).to(torch.float32))
