"""SecAgg's quantizer: clipping, stochastic rounding (unbiased, by hand in exact arithmetic) and
its fraction bits."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedweave.plugins.secure.secagg import Quantizer

from ...helpers import make, update
from .rounds import Federation, unmask


def test_stochastic_rounding_is_unbiased() -> None:
    """An update of constant value between two levels averages to that value over many clients."""
    plugin = make("secagg", clients=40, neighbours=4, clip_range=1.0, max_examples=2**16)
    fed = Federation(plugin)
    plugin.setup(1, list(range(40)), fed.exchange)
    step = 2 / plugin.levels
    value = -1 + 1000.3 * step  # 0.3 of a step above level 1000
    ups = [update({"w": torch.full((500,), value)}, num_examples=1, client_id=u) for u in range(40)]
    result = unmask(plugin, fed, [plugin.encode(u, fed.ctx(u.client_id)) for u in ups])["w"]
    # 20,000 Bernoulli(0.3) draws: the mean is within 4 standard errors of 0.3 of a step
    assert abs((result.double().mean().item() - value) / step) < 4 * math.sqrt(0.21 / 20000)


@pytest.mark.parametrize(("levels", "width"), [(2**16 - 1, 32), (2**28 - 1, 32), (2**40 - 1, 64)])
def test_quantization_skips_clipping_only_where_it_changes_nothing(levels: int, width: int) -> None:
    """Within the margin :meth:`Quantizer.inside` allows, the quantized values are those of
    the clipping pass, at both ends of the range and for every real type; outside, the
    clipping pass keeps every value within [0, L]."""
    quantize = Quantizer.of(1.0, levels, width)
    fine = 2.0 / (levels * (1 << quantize.fraction_bits))
    edge = np.array([-1 + 2.5 * fine, 1 - 2.5 * fine, 0.0, 0.5, -0.999, 0.999], dtype=quantize.real)  # half a fine step inside
    x = np.concatenate([edge, np.random.default_rng(0).uniform(-1, 1, 994).astype(quantize.real)])
    assert quantize.inside(float(x.min()), float(x.max()))
    assert not quantize.inside(-1.0, 0.5) and not quantize.inside(-0.5, 1.0)
    out_type = np.uint32 if width == 32 else np.uint64
    noise = np.random.default_rng(1).integers(0, 256, x.size, dtype=np.uint8)
    got = {}
    for inside in (False, True):
        out, spare = np.empty(x.size, out_type), np.empty(x.size, out_type)
        quantize(x, noise, x.copy(), spare, out, inside)
        got[inside] = out
    assert np.array_equal(got[False], got[True])
    out, spare = np.empty(3, out_type), np.empty(3, out_type)
    quantize(np.array([-5.0, 1.0, 7.0], quantize.real), np.full(3, 255, np.uint8), np.empty(3, quantize.real), spare, out)
    assert out.tolist() == [0, levels, levels]


@pytest.mark.parametrize(("clip", "levels", "width"), [(2.0, 2**16 - 1, 32), (0.5, 2**28 - 1, 32)])
def test_quantization_by_hand(clip: float, levels: int, width: int) -> None:
    """q = ⌊(⌊t·2^f + ½⌋ + (noise >> (8 − f))) / 2^f⌋ with t = (clip(x) + R)·L / 2R, in exact arithmetic,
    for 8 fraction bits (float32) and for 4 (L = 2^28 − 1 leaves 4 bits of a 32-bit field)."""
    from fractions import Fraction

    quantize = Quantizer.of(clip, levels, width)
    f = quantize.fraction_bits
    assert f == (8 if levels < 2**20 else 4)
    rng = np.random.default_rng(5)
    x = np.concatenate([rng.uniform(-clip, clip, 300), [-clip, clip, -3 * clip, 3 * clip, 0.0]]).astype(quantize.real)
    noise = np.concatenate([rng.integers(0, 256, 300), [0, 0, 255, 0, 255]]).astype(np.uint8)
    out, spare = np.empty(x.size, np.uint32), np.empty(x.size, np.uint32)
    quantize(x, noise, np.empty(x.size, quantize.real), spare, out)
    for xi, ni, qi in zip(x.tolist(), noise.tolist(), out.tolist()):
        t = (Fraction(min(max(xi, -clip), clip)) + Fraction(clip)) * levels / (2 * Fraction(clip))
        fine = int(t * 2**f + Fraction(1, 2))  # to the nearest multiple of 2^-f
        assert abs(qi - (fine + (ni >> (8 - f))) // 2**f) <= (1 if quantize.real is np.float32 else 0), (xi, ni)
    assert out[-5] == 0 and out[-4] == levels and out[-3] == 0 and out[-2] == levels  # the ends, clipped or not
    fine_step = 2 * clip / (levels * (1 << f))
    margin = 2 * fine_step
    assert quantize.inside(-clip + margin, clip - margin)  # the margin itself is inside
    assert not quantize.inside(-clip + 1.5 * fine_step, 0.0) and not quantize.inside(0.0, clip - 1.5 * fine_step)


def test_fraction_bits_follow_the_real_type_and_the_field() -> None:
    """f = min(8, mantissa − used bits, width − used bits), at least 0: the rounding never overflows."""
    assert Quantizer.of(1.0, 2**16 - 1, 32).real is np.float32 and Quantizer.of(1.0, 2**17 - 1, 32).real is np.float64
    assert Quantizer.of(1.0, 2**32 - 1, 32).fraction_bits == 0  # max_examples 1: no room left in the field
    assert Quantizer.of(1.0, 2**48 - 1, 64).fraction_bits == 5  # float64's 53 bits bind before the field's 64
