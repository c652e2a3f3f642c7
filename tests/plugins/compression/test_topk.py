"""Top-k's codec: the residual error feedback keeps, and a payload's tensors decoded at once."""

from __future__ import annotations

import pytest
import torch

from fedweave.plugins.compression.topk import TopKCodec, TopKHParams
from fedweave.plugins.compression.wire import Site

from ..helpers import make
from . import reference as ref

SITE = Site("topk", 0, "up", 1, 0, "w")


def test_the_rest_kept_is_x_less_what_was_sent() -> None:
    """k = 2 of 5: -4 and 3 are sent; float32 values leave exact zeros where they were."""
    x = torch.tensor([1.0, -4.0, 0.5, 3.0, -2.0])
    [fields] = TopKCodec(TopKHParams(ratio=0.4)).compress_keeping_rest([x], [SITE])
    assert fields["values"].tolist() == [-4.0, 3.0]
    assert (fields["indices"].long() + 32_768).tolist() == [1, 3]
    assert x.tolist() == [1.0, 0.0, 0.5, 0.0, -2.0]


def test_values_in_fewer_bits_leave_their_rounding_in_the_rest() -> None:
    x = torch.tensor([0.1, 3.0e-5, 1.0 / 3.0, 0.0])
    original = x.clone()
    [fields] = TopKCodec(TopKHParams(ratio=0.5, values="float16")).compress_keeping_rest([x], [SITE])
    sent = original[[0, 2]].to(torch.float16)
    assert torch.equal(fields["values"], sent)
    rest = original.clone()
    rest[[0, 2]] -= sent.to(torch.float32)  # in float32, as error feedback subtracts it
    assert torch.equal(x, rest)
    assert x[0].item() != 0.0  # 0.1 is not a float16


def test_the_rest_equals_x_less_the_decoded_fields_and_the_fields_those_compress_sends() -> None:
    codec = TopKCodec(TopKHParams(ratio=0.01))
    xs = [torch.randn(300, 500, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    sites = [Site("topk", 0, "up", 1, 0, str(i)) for i in range(3)]
    plain = [codec.compress(x, s) for x, s in zip(xs, sites)]
    kept = [x.clone() for x in xs]
    fields = codec.compress_keeping_rest(kept, sites)
    for x, rest, got, want in zip(xs, kept, fields, plain):
        assert got.keys() == want.keys() and all(torch.equal(got[f], want[f]) for f in got)
        assert torch.equal(rest, x - codec.decompress(got, tuple(x.shape)))


def test_a_payload_s_tensors_decode_at_once_into_their_own_shapes() -> None:
    """Three tensors scattered into one buffer: each its own zeros and sent values."""
    codec = TopKCodec(TopKHParams(ratio=0.5))
    xs = [torch.tensor([[0.0, 2.0], [-3.0, 1.0]]), torch.tensor([5.0, -1.0, 0.0]), torch.tensor([-7.0])]
    fields = [codec.compress(x, SITE) for x in xs]
    got = codec.decompress_many(fields, [tuple(x.shape) for x in xs])
    assert [g.tolist() for g in got] == [[[0.0, 2.0], [-3.0, 0.0]], [5.0, 0.0, 0.0], [-7.0]]


@pytest.mark.parametrize("name,part,shape", [
    ("big", "values", (1, -1)), ("big", "values", (-1, 1)), ("big", "indices", (1, -1)), ("big", "indices", (-1, 1)),
    ("big", "blocks", (1, -1)), ("one", "values", ()), ("one", "indices", ()), ("one", "indices", (1, 1)),
])
def test_a_field_of_its_size_that_is_not_a_vector_is_refused_with_a_reason(name: str, part: str, shape: tuple) -> None:
    """top-k sends vectors; a peer's field of the right size as a row, a column or a 0-d tensor
    is refused as the field it is, not by an IndexError or a RuntimeError from inside the decode
    (a row of positions passed the increasing check, which compares along the first dimension)."""
    plugin = make("topk", ratio=0.01)
    g = torch.Generator().manual_seed(0)
    model = {"big": torch.randn(2, 65_536, generator=g), "one": torch.randn(50, generator=g)}  # k = 1310 and 1
    ref.refuses_reshaped_field(plugin, model, name, part, shape)
