"""QSGD's one-matrix encoding of a whole update against the definition, tensor by tensor:
the same levels, norms and decoded floats bit for bit, for several shapes, bucket sizes
that do not divide them, zeros, and 4-bit, 8-bit and 16-bit levels."""

from __future__ import annotations

import pytest
import torch

from fedweave.plugins.compression.qsgd import QSGDCodec, QSGDHParams, to_levels

from ..helpers import make
from . import reference as ref
from .reference import SHAPES, same


def encode(s: int, size: int, xs: list[torch.Tensor]) -> tuple[QSGDCodec, list[dict[str, torch.Tensor]], list]:
    codec = QSGDCodec(QSGDHParams(levels=s, bucket=size))
    sites = [ref.site(f"t{i}") for i in range(len(xs))]
    return codec, codec.compress_many(xs, sites), sites


@pytest.mark.parametrize("s", [2, 7, 127, 300])
@pytest.mark.parametrize("size", [1, 7, 64, 512])
def test_levels_and_norms_of_every_tensor_are_the_definitions(s: int, size: int) -> None:
    xs = ref.tensors(s * size, SHAPES)
    codec, fields, sites = encode(s, size, xs)
    for x, f, where in zip(xs, fields, sites):
        levels, norms = ref.qsgd(x, s, size, where)
        assert same(f["norms"], norms)
        if s <= 7:
            assert f.keys() == {"nibbles", "norms"} and same(f["nibbles"], ref.nibbles(levels))
        else:
            assert f.keys() == {"levels", "norms"}
            assert same(f["levels"], levels.to(torch.int8 if s <= 127 else torch.int16))
        alone = codec.compress(x, where)  # the tensor on its own: the same fields
        assert alone.keys() == f.keys() and all(same(alone[k], f[k]) for k in f)


@pytest.mark.parametrize("s", [2, 7, 127, 300])
@pytest.mark.parametrize("size", [1, 7, 512])
def test_decoded_values_are_level_times_norm_over_s_whether_fields_share_a_buffer_or_not(s: int, size: int) -> None:
    xs = ref.tensors(1000 + s + size, SHAPES)
    codec, fields, sites = encode(s, size, xs)
    shapes = [tuple(x.shape) for x in xs]
    expected = [ref.qsgd_decoded(*ref.qsgd(x, s, size, where), s, size) for x, where in zip(xs, sites)]
    received = {
        "as encoded (views of one buffer)": (fields, shapes, expected),
        "copied (as from a peer)": ([{k: v.clone() for k, v in f.items()} for f in fields], shapes, expected),
        "in another order": (fields[::-1], shapes[::-1], expected[::-1]),
    }
    for how, (parts, layout, want) in received.items():
        out = codec.decompress_many(parts, layout)
        assert [tuple(t.shape) for t in out] == layout, how
        assert all(same(got.reshape(-1), w) for got, w in zip(out, want)), how


@pytest.mark.parametrize("s", [2, 7, 127, 300])
def test_levels_are_magnitude_over_norm_then_times_s_to_the_last_bit(s: int) -> None:
    g = torch.Generator().manual_seed(s)
    magnitudes = torch.rand(64, 33, generator=g) * torch.logspace(-6, 6, 64).view(-1, 1)
    magnitudes[5] = 0.0
    norms = torch.linalg.vector_norm(magnitudes, dim=1, keepdim=True)
    scaled = magnitudes / torch.where(norms > 0, norms, torch.ones_like(norms)) * s  # (|v| / n) * s
    for noise, up in zip(ref.straddling_noise(scaled), (False, True)):
        rows = magnitudes.clone()
        assert same(to_levels(rows, s, noise.clone()), norms)
        want = torch.floor(scaled) + (up & (scaled > torch.floor(scaled)))
        assert same(rows, want)


def test_a_zero_tensor_and_zero_buckets_encode_to_zero_levels_and_zero_norms() -> None:
    x = torch.zeros(10)
    x[7] = -2.0  # buckets of 4: [0 0 0 0] [0 0 0 -2] [0 0]
    codec, (f,), _ = encode(127, 4, [x])
    assert same(f["norms"], torch.tensor([0.0, 2.0, 0.0]))
    assert same(f["levels"], torch.tensor([0, 0, 0, 0, 0, 0, 0, -127, 0, 0], dtype=torch.int8))
    assert same(codec.decompress_many([f], [(10,)])[0], x)


def test_fields_of_the_wrong_size_are_refused_even_when_they_share_the_senders_buffer() -> None:
    codec, fields, _ = encode(127, 7, ref.tensors(5, SHAPES))
    short = [dict(f) for f in fields]
    short[1]["levels"] = fields[1]["levels"][:-1]  # a view into the same buffer, one entry short
    with pytest.raises(ValueError, match="levels hold"):
        codec.decompress_many(short, SHAPES)


@pytest.mark.parametrize("s", [7, 127])
def test_a_bucket_too_small_to_square_keeps_its_levels_within_s_and_its_signs(s: int) -> None:
    """Entries around 1e-22 square to subnormals: the float32 norm of [-1e-22, 1e-23, 0, -1e-24]
    comes out below 1e-22 (about 0.99e-22), so |v| / n * s passed s and the int8 or 4-bit code wrapped to the
    other sign. The levels stop at s; the decoded entries keep their signs."""
    x = torch.tensor([-1e-22, 1e-23, 0.0, -1e-24])
    norm = torch.linalg.vector_norm(x)
    assert 0 < norm < 1e-22  # the norm is under the largest magnitude: what this guards against
    codec, fields, _ = encode(s, 4, [x])
    codes = qsgd_codes(fields[0], 4)
    assert codes.abs().max() <= s and codes[0] == -s
    decoded = codec.decompress(fields[0], (4,))
    assert decoded[0] < 0 and decoded[1] >= 0 and decoded[3] <= 0
    assert torch.equal(decoded[0], -norm)  # s levels of the norm


def test_an_ordinary_bucket_is_not_clamped_the_norm_is_at_least_every_magnitude() -> None:
    """Above the lossy norms a level reaches s only at the bucket's one nonzero entry."""
    x = torch.tensor([0.0, -2.5, 0.0, 0.0])
    _, fields, _ = encode(127, 4, [x])
    assert qsgd_codes(fields[0], 4).tolist() == [0, -127, 0, 0]


@pytest.mark.parametrize("s", [7, 127])
def test_a_bucket_with_a_nan_keeps_its_levels_within_s(s: int) -> None:
    """A NaN makes its bucket's norm NaN (divisor 1): the other entries' |v| * s passed s and
    wrapped to the other sign. They stop at s; the NaN norm travels, so the bucket decodes to NaN."""
    x = torch.tensor([float("nan"), -3.0, 1.5, 0.0, 1.0, 2.0, 0.0, 0.0])
    codec, fields, _ = encode(s, 4, [x])
    codes = qsgd_codes(fields[0], 8)
    assert codes[1:4].tolist() == [-s, s, 0] and codes[1:].abs().max() <= s  # (the NaN: whatever NaN converts to)
    assert codec.decompress(fields[0], (8,))[:4].isnan().all()


def qsgd_codes(fields: dict[str, torch.Tensor], numel: int) -> torch.Tensor:
    """The signed levels a tensor's fields carry, as integers (4-bit ones unpacked)."""
    if "nibbles" in fields:
        packed = fields["nibbles"].long()
        return torch.stack([packed >> 4, packed & 15], dim=1).reshape(-1)[:numel] - 8
    return fields["levels"].long()


@pytest.mark.parametrize("s,name,part,shape", [(7, "pair", "nibbles", ()), (7, "w", "nibbles", (1, -1)),
                                               (7, "w", "norms", (-1, 1)), (127, "w", "levels", (2, -1))])
def test_a_field_of_its_size_that_is_not_a_vector_is_refused_with_a_reason(s: int, name: str, part: str, shape: tuple) -> None:
    """QSGD sends vectors: 4-bit levels of a 2-entry tensor as a 0-d byte raised an IndexError
    from inside the decode, and a row of them decoded its high nibbles first, not as sent."""
    plugin = make("qsgd", levels=s, bucket=4)
    g = torch.Generator().manual_seed(0)
    model = {"w": torch.randn(3, 6, generator=g), "pair": torch.randn(2, generator=g)}
    ref.refuses_reshaped_field(plugin, model, name, part, shape)
