"""The compression codecs on hand-made vectors: exact wire fields and bytes, exact decoded
values, and the fast paths (top-k's sampled selection, random-k's reused positions)
giving what the plain computation gives."""

from __future__ import annotations

import resource
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import LargestTensor
from fedweave.plugins.compression import randk as randk_mod
from fedweave.plugins.compression.topk import largest
from fedweave.plugins.compression.wire import Site
from fedweave.types import Instruction, TaskKind, Work, params_nbytes

from .helpers import ctx, make, roundtrip, update

SITE = Site("test", 0, "up", 1, 0, "w")


def wire(plugin_name: str, x: torch.Tensor, **params: object) -> dict[str, torch.Tensor]:
    """The fields of ``x`` on the wire, without the layout (dtype code and shape, int32)."""
    encoded = make(plugin_name, **params).encode(update({"w": x}), ctx()).tensors
    assert torch.equal(encoded.pop("w.__layout"), torch.tensor([0, *x.shape], dtype=torch.int32))
    return {k.removeprefix("w.__"): v for k, v in encoded.items()}


def test_topk_fields_bytes_and_decoded_values_of_a_hand_made_vector() -> None:
    x = torch.tensor([0.5, -3.0, 1.0, 0.0, 2.0, -0.25, 0.125, 4.0])
    fields = wire("topk", x, ratio=0.375, error_feedback=False)  # k = 3
    assert torch.equal(fields["values"], torch.tensor([-3.0, 2.0, 4.0]))
    assert torch.equal(fields["indices"], torch.tensor([1 - 32768, 4 - 32768, 7 - 32768], dtype=torch.int16))
    assert fields.keys() == {"values", "indices"}
    assert params_nbytes(fields) == 3 * 4 + 3 * 2
    out = roundtrip(make("topk", ratio=0.375, error_feedback=False), update({"w": x}), ctx()).tensors["w"]
    assert torch.equal(out, torch.tensor([0.0, -3.0, 0.0, 0.0, 2.0, 0.0, 0.0, 4.0]))


def test_topk_positions_past_one_block_travel_as_offsets_and_counts() -> None:
    x = torch.zeros(70000)
    x[[5, 65535, 65536, 69999]] = torch.tensor([1.0, -2.0, 3.0, -4.0])
    fields = wire("topk", x, ratio=4.5 / 70000, error_feedback=False)  # k = 4
    offsets = torch.tensor([5, 65535, 0, 69999 - 65536]) - 32768
    assert torch.equal(fields["indices"], offsets.to(torch.int16))
    assert torch.equal(fields["blocks"], torch.tensor([2, 2], dtype=torch.int32))
    assert params_nbytes(fields) == 4 * 4 + 4 * 2 + 2 * 4


def test_int8_fields_and_decoded_values_of_a_hand_made_vector() -> None:
    x = torch.tensor([0.5, -1.27, 0.1, 0.0, 0.3])
    fields = wire("quantize", x, dtype="int8", bucket=2, stochastic=False)
    scales = torch.tensor([1.27, 0.1, 0.3]) / 127  # the largest magnitude of each bucket of 2
    assert torch.equal(fields["scales"], scales)
    assert torch.equal(fields["values"], torch.tensor([50, -127, 127, 0, 127], dtype=torch.int8))
    assert params_nbytes(fields) == 5 * 1 + 3 * 4
    out = roundtrip(make("quantize", dtype="int8", bucket=2, stochastic=False), update({"w": x}), ctx()).tensors["w"]
    assert torch.equal(out, torch.tensor([50.0, -127.0, 127.0, 0.0, 127.0]) * scales[[0, 0, 1, 1, 2]])


def test_qsgd_levels_are_the_two_neighbours_chosen_by_the_sites_draws() -> None:
    x = torch.tensor([3.0, -4.0, 0.0, 0.0, 0.0, 0.5])  # buckets of 4: norms 5 and 0.5
    fields = wire("qsgd", x, levels=2, bucket=4)
    assert torch.equal(fields["norms"], torch.tensor([5.0, 0.5]))
    assert params_nbytes(fields) == 3 + 2 * 4  # six 4-bit levels in 3 bytes
    # |v| / norm * s = 1.2, 1.6, 0, 0 | 0, 2 (then padding): up with probability 0.2, 0.6
    noise = torch.rand(8, generator=Site("qsgd", 0, "up", 1, 0, "w").generator(0, "w"))
    up = (noise[:2] < torch.tensor([1.2, 1.6]) - 1).long()
    levels = [1 + int(up[0]), -1 - int(up[1]), 0, 0, 0, 2]
    codes = [v + 8 for v in levels]  # offset by 8, two per byte
    assert fields["nibbles"].tolist() == [codes[0] << 4 | codes[1], codes[2] << 4 | codes[3], codes[4] << 4 | codes[5]]
    out = roundtrip(make("qsgd", levels=2, bucket=4), update({"w": x}), ctx()).tensors["w"]
    assert torch.equal(out, torch.tensor(levels, dtype=torch.float32) * torch.tensor([5.0] * 4 + [0.5] * 2) / 2)
    eight_bit = wire("qsgd", x, levels=127, bucket=4)
    assert eight_bit["levels"].dtype == torch.int8 and params_nbytes(eight_bit) == 6 * 1 + 2 * 4


def test_randk_sends_the_seeded_positions_scaled_and_decodes_them_anywhere() -> None:
    x = torch.arange(1.0, 21.0)
    fields = wire("randk", x, ratio=0.2)  # k = 4 of 20, unbiased: values × 20 / 4
    seed = int(fields["seed"].item())
    positions = torch.randperm(20, generator=torch.Generator().manual_seed(seed))[:4]
    assert torch.equal(fields["values"], x[positions] * 5)
    assert params_nbytes(fields) == 4 * 4 + 8
    encoded = make("randk", ratio=0.2).encode(update({"w": x}), ctx())
    fresh = make("randk", ratio=0.2)  # another process: draws the positions from the seed
    out = fresh.decode(encoded, ctx(side="server")).tensors["w"]
    expected = torch.zeros(20)
    expected[positions] = x[positions] * 5
    assert torch.equal(out, expected)


def test_randk_keeps_a_bounded_number_of_drawn_positions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(randk_mod, "HELD_POSITIONS", 25)
    codec = randk_mod.RandKCodec(randk_mod.RandKHParams(ratio=0.1))
    for seed in range(10):
        positions = codec._positions(seed, 100)  # 10 each: at most 2 kept
        assert torch.equal(positions, torch.randperm(100, generator=torch.Generator().manual_seed(seed))[:10].int())
        assert codec.held == sum(p.numel() for p in codec.drawn.values()) <= 25
    assert list(codec.drawn) == [(8, 100), (9, 100)]


def reference(magnitude: torch.Tensor, k: int) -> torch.Tensor:
    return magnitude.topk(k, sorted=False).indices.sort().values


@pytest.mark.parametrize("case", ["normal", "zeros", "ties at the threshold", "nan", "nan in the sample", "few distinct", "small"])
def test_largest_picks_the_positions_topk_picks(case: str) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(100_000, generator=g).abs()
    if case == "zeros":
        x[torch.randperm(100_000, generator=g)[:97_000]] = 0  # fewer nonzero entries than twice k
    elif case == "ties at the threshold":
        x = x.clamp(max=2.0)  # ~4,500 entries equal 2.0, k = 1,000 of them
    elif case == "nan":
        x[[17, 40_000]] = float("nan")
    elif case == "nan in the sample":
        x[[0, 24 * 7]] = float("nan")  # the strided sample reads every 24th entry
    elif case == "few distinct":
        x = (x * 4).floor()
    elif case == "small":
        x = x[:300]
    k = max(1, x.numel() // 100)
    assert torch.equal(largest(x, k), reference(x, k))


def test_int8_quantizes_every_tensor_of_an_update_in_its_own_buckets() -> None:
    """The tensors of an update share one bucket matrix, each padded to whole buckets: the
    second tensor's first bucket starts afresh (its own scale), as if encoded alone."""
    a = torch.tensor([0.5, -1.27, 0.1])  # buckets of 2: [0.5, -1.27], [0.1, (pad)]
    b = torch.tensor([[0.3, -0.6], [1.2, 0.0]])  # [0.3, -0.6], [1.2, 0.0]
    encoded = make("quantize", dtype="int8", bucket=2, stochastic=False).encode(update({"a": a, "b": b}), ctx()).tensors
    assert torch.equal(encoded["a.__scales"], torch.tensor([1.27, 0.1]) / 127)
    assert torch.equal(encoded["b.__scales"], torch.tensor([0.6, 1.2]) / 127)
    assert torch.equal(encoded["a.__values"], torch.tensor([50, -127, 127], dtype=torch.int8))
    assert torch.equal(encoded["b.__values"], torch.tensor([64, -127, 127, 0], dtype=torch.int8))  # 63.5 rounds to even
    assert params_nbytes(encoded) == (3 + 2 * 4 + 2 * 4) + (4 + 2 * 4 + 3 * 4)  # values, scales, layouts


@pytest.mark.parametrize("name,params", [("qsgd", {"levels": 127, "bucket": 64}), ("qsgd", {"levels": 7, "bucket": 64}),
                                         ("quantize", {"dtype": "int8", "bucket": 64})])
def test_an_update_encodes_as_its_tensors_would_alone(name: str, params: dict) -> None:
    """One pass over all tensors draws each tensor's noise from its own generator: every
    field and decoded value equals that of the tensor encoded alone (sizes 1 to 3 buckets,
    with and without padding)."""
    g = torch.Generator().manual_seed(5)
    tensors = {"w": torch.randn(3, 64, generator=g), "b": torch.randn(70, generator=g), "c": torch.randn(1, generator=g)}
    plugin = make(name, **params)
    together = plugin.encode(update(tensors), ctx()).tensors
    decoded = plugin.decode(update(together), ctx(side="server")).tensors
    for key, tensor in tensors.items():
        alone = plugin.encode(update({key: tensor}), ctx()).tensors
        assert alone.keys() <= together.keys()
        assert all(torch.equal(together[k], v) for k, v in alone.items())
        assert torch.equal(decoded[key], plugin.decode(update(alone), ctx(side="server")).tensors[key])


@pytest.mark.parametrize("name,field,size", [("qsgd", "levels", 129), ("qsgd", "norms", 3), ("quantize", "values", 1),
                                             ("quantize", "scales", 1)])
def test_a_field_of_the_wrong_size_is_refused(name: str, field: str, size: int) -> None:
    plugin = make(name, bucket=64)
    encoded = plugin.encode(update({"w": torch.randn(2, 64)}), ctx()).tensors  # 128 entries, 2 buckets
    encoded[f"w.__{field}"] = encoded[f"w.__{field}"].new_zeros(size)
    with pytest.raises(ValueError, match=field):
        plugin.decode(update(encoded), ctx(side="server"))


@pytest.mark.parametrize("name,params", [("topk", {"ratio": 0.1}), ("randk", {"ratio": 0.1, "error_feedback": True}),
                                         ("qsgd", {"levels": 3, "error_feedback": True})])
def test_error_feedback_keeps_exactly_what_was_not_sent(name: str, params: dict) -> None:
    """The residual, updated in place, is the update plus the last residual less the decoded
    update, to the bit; the update given to the plugin is left as it was."""
    plugin = make(name, **params)
    g = torch.Generator().manual_seed(1)
    carried = torch.zeros(20, 15)
    for rnd in (1, 2, 3):
        x = torch.randn(15, 20, generator=g).t()  # not contiguous
        kept = x.clone()
        sent = roundtrip(plugin, update({"w": x}), ctx(rnd)).tensors["w"]
        assert torch.equal(x, kept)
        assert torch.equal(plugin.residuals[0]["w"], (x + carried) - sent)
        carried = plugin.residuals[0]["w"].clone()


def test_powersgd_fields_are_laid_out_as_the_receiver_gets_them() -> None:
    """The wire carries tensors C-contiguous; a sender holding another layout (QR's Q is
    column-major) would decode other bits than its receiver (matmul's rounding depends on
    the layout): the residual and the server's copy of a client's model would drift."""
    plugin = make("powersgd", rank=2, error_feedback=False)
    for seed in range(20):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(seed)) * 0.01
        fields = wire("powersgd", x, rank=2, error_feedback=False)
        assert all(f.is_contiguous() for f in fields.values())
        received = {k: v.contiguous() for k, v in fields.items()}  # what deserialization builds
        assert torch.equal(plugin.codec.decompress(fields, (4, 16)), plugin.codec.decompress(received, (4, 16)))


@pytest.mark.parametrize("name,params", [("topk", {"ratio": 0.25}), ("topk", {"ratio": 0.25, "error_feedback": False}),
                                         ("randk", {"ratio": 0.25}), ("randk", {"ratio": 0.25, "error_feedback": True}),
                                         ("qsgd", {"levels": 7, "bucket": 4}), ("qsgd", {"levels": 127, "bucket": 4}),
                                         ("quantize", {"dtype": "int8", "bucket": 4}), ("quantize", {"dtype": "float16"}),
                                         ("quantize", {"dtype": "bfloat16"}), ("powersgd", {"rank": 1})])
def test_an_empty_tensor_next_to_a_normal_one_comes_back_empty(name: str, params: dict) -> None:
    """A model may hold a zero-size tensor (an empty buffer): it comes back with its shape, in
    both directions and through error feedback, and the tensor beside it decodes as alone."""
    x = torch.tensor([[0.5, -3.0, 1.0, 0.0], [2.0, -0.25, 0.125, 4.0]])
    tensors = {"empty": torch.zeros(0), "matrix": torch.zeros(3, 0), "w": x}
    plugin, alone = make(name, **params), make(name, **params)
    for rnd in (1, 2):
        out = roundtrip(plugin, update(tensors), ctx(rnd)).tensors
        assert out["empty"].shape == (0,) and out["matrix"].shape == (3, 0)
        assert torch.equal(out["w"], roundtrip(alone, update({"w": x}), ctx(rnd)).tensors["w"])
    server, client = make(name, **params), make(name, **params)
    for rnd in (1, 2):  # the second broadcast is a compressed delta
        model = {k: v + rnd for k, v in tensors.items()}
        got = client.decode(server.encode(Instruction(rnd, TaskKind.TRAIN, Work(0, 8), model), ctx(rnd, 0, "server")),
                            ctx(rnd, 0, "client")).params
        assert got["empty"].shape == (0,) and got["matrix"].shape == (3, 0) and got["w"].shape == x.shape


@pytest.mark.parametrize("name,params,field,dtype", [
    ("topk", {"ratio": 0.5}, "indices", torch.int64), ("topk", {"ratio": 0.5}, "values", torch.float16),
    ("topk", {"ratio": 0.5, "values": "float16"}, "values", torch.float32), ("randk", {}, "seed", torch.float64),
    ("qsgd", {"levels": 7}, "nibbles", torch.int8), ("qsgd", {"levels": 127}, "levels", torch.int16),
    ("qsgd", {"levels": 1000}, "levels", torch.float32), ("qsgd", {}, "norms", torch.float64),
    ("quantize", {}, "values", torch.uint8), ("quantize", {"dtype": "bfloat16"}, "values", torch.float16),
    ("powersgd", {"rank": 1}, "p", torch.float64),
])
def test_a_field_of_another_dtype_than_its_codec_sends_is_refused(name: str, params: dict, field: str,
                                                                   dtype: torch.dtype) -> None:
    """What a peer sent is checked before it is decoded: each field must have the dtype this
    codec, so configured, gives it (an int64 position list or float levels decode to
    something, just not to what any honest sender sent)."""
    plugin = make(name, **params)
    encoded = plugin.encode(update({"w": torch.randn(4, 8)}), ctx()).tensors
    plugin.decode(update(encoded), ctx(side="server"))  # as sent: decodes
    for key, value in (field, encoded[f"w.__{field}"].to(dtype)), ("extra", torch.zeros(1)):
        with pytest.raises(ValueError, match=f"field '{key}' of 'w' is "):
            plugin.decode(update({**encoded, f"w.__{key}": value}), ctx(side="server"))


def _layout(numel: int, dtype: int = 0) -> torch.Tensor:
    return torch.tensor([dtype, numel], dtype=torch.int32)


def _offsets(*positions: int) -> torch.Tensor:
    return torch.tensor([p - 32768 for p in positions], dtype=torch.int16)


BIG = 1 << 26
"""Entries a forged layout claims: before its fields were checked against it, decoding one
of the payloads below built 256 MB to 1.5 GB and took seconds."""

FORGED = {  # (plugin, params, payload of tensor "w", what the refusal names)
    "topk blocks claim 2^26 positions of a 10-entry tensor (4 bytes)": (
        "topk", {}, {"w.__layout": _layout(10), "w.__values": torch.ones(1), "w.__indices": _offsets(3),
                     "w.__blocks": torch.tensor([BIG], dtype=torch.int32)}, "'blocks' for a tensor of 10 entries"),
    "topk blocks of a 2-block tensor claim 2^26 positions": (
        "topk", {}, {"w.__layout": _layout(70_000), "w.__values": torch.ones(700), "w.__indices": _offsets(*range(700)),
                     "w.__blocks": torch.tensor([BIG, 0], dtype=torch.int32)}, "do not sum to the 700 positions"),
    "topk blocks with a negative count": (
        "topk", {}, {"w.__layout": _layout(70_000), "w.__values": torch.ones(700), "w.__indices": _offsets(*range(700)),
                     "w.__blocks": torch.tensor([-1, 701], dtype=torch.int32)}, "negative"),
    "topk blocks of another number than the tensor's blocks": (
        "topk", {}, {"w.__layout": _layout(70_000), "w.__values": torch.ones(700), "w.__indices": _offsets(*range(700)),
                     "w.__blocks": torch.tensor([700], dtype=torch.int32)}, "hold 1 counts, the layout's tensor has 2"),
    "topk offset past the end of the last block": (
        "topk", {}, {"w.__layout": _layout(70_000), "w.__values": torch.ones(700),
                     "w.__indices": _offsets(*range(699), 5_000), "w.__blocks": torch.tensor([0, 700], dtype=torch.int32)},
        "not increasing positions below 70000"),
    "topk positions repeated": (
        "topk", {"ratio": 0.5}, {"w.__layout": _layout(4), "w.__values": torch.ones(2), "w.__indices": _offsets(1, 1)},
        "not increasing"),
    "topk float64 layout of 2^26 entries with one value": (
        "topk", {}, {"w.__layout": _layout(BIG, dtype=1), "w.__values": torch.ones(1), "w.__indices": _offsets(0)},
        "'values' hold 1 entries, the layout's tensor sends 671088"),
    "topk without its indices": ("topk", {}, {"w.__layout": _layout(10), "w.__values": torch.ones(1)},
                                 "'indices' is missing"),
    "randk layout of 2^26 entries with one value (12 bytes)": (
        "randk", {}, {"w.__layout": _layout(BIG), "w.__values": torch.ones(1), "w.__seed": torch.tensor([7])},
        "'values' hold 1 entries, the layout's tensor sends 6710886"),
    "powersgd p and q of 8192 rows for a 4 x 4 matrix": (
        "powersgd", {}, {"w.__layout": torch.tensor([0, 4, 4], dtype=torch.int32), "w.__p": torch.ones(8192, 1),
                         "w.__q": torch.ones(8192, 1)}, "'p' hold 8192 entries, the layout's tensor sends 16"),
    "powersgd p and q transposed": (
        "powersgd", {"rank": 1}, {"w.__layout": torch.tensor([0, 8, 4], dtype=torch.int32), "w.__p": torch.ones(1, 8),
                                  "w.__q": torch.ones(1, 4)}, r"'p' is \(1, 8\) and 'q' \(1, 4\)"),
    "qsgd 4-bit levels of 2^20 bytes for a 10-entry tensor": (
        "qsgd", {"levels": 7}, {"w.__layout": _layout(10), "w.__nibbles": torch.zeros(1 << 20, dtype=torch.uint8),
                                "w.__norms": torch.ones(1)}, "'nibbles' hold 1048576 entries, the layout's tensor sends 5"),
    "qsgd layout of 2^26 entries with one level": (
        "qsgd", {}, {"w.__layout": _layout(BIG), "w.__levels": torch.ones(1, dtype=torch.int8), "w.__norms": torch.ones(1)},
        "'levels' hold 1 entries"),
    "int8 scales of 2^20 buckets for a 10-entry tensor": (
        "quantize", {}, {"w.__layout": _layout(10), "w.__values": torch.ones(10, dtype=torch.int8),
                         "w.__scales": torch.ones(1 << 20)}, "'scales' hold 1048576 entries, the layout's tensor sends 1"),
    "float16 values of another number than the layout's": (
        "quantize", {"dtype": "float16"}, {"w.__layout": _layout(BIG), "w.__values": torch.ones(3, dtype=torch.float16)},
        "'values' hold 3 entries"),
    "a layout with a negative size": (
        "quantize", {"dtype": "float16"}, {"w.__layout": _layout(-3), "w.__values": torch.ones(3, dtype=torch.float16)},
        "negative size"),
}


@pytest.mark.parametrize("case", list(FORGED))
def test_fields_that_do_not_fit_their_layout_are_refused_before_anything_is_built(case: str) -> None:
    """Each codec checks a peer's fields against the layout they claim (sizes, block counts,
    positions) before it allocates: refused with a reason, no tensor of 2^21 entries built, the
    process's peak memory unmoved (each payload cost 256 MB or more before)."""
    name, params, tensors, reason = FORGED[case]
    plugin = make(name, **params)
    with LargestTensor() as built, pytest.raises(ValueError, match=reason):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        plugin.decode(replace(update(tensors), applied=[name]), ctx(side="server"))
    assert built.entries < 1 << 21  # each payload built a tensor of 2^26 entries or more before
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 64 * 1024  # KiB


@pytest.mark.parametrize("name,params", [("topk", {"ratio": 0.01}), ("randk", {}), ("qsgd", {"levels": 7}),
                                         ("quantize", {}), ("powersgd", {"rank": 2})])
def test_a_tensor_of_two_blocks_and_every_codec_s_honest_fields_pass_the_checks(name: str, params: dict) -> None:
    """What an honest sender encodes passes the checks and decodes as before them: a tensor
    of two blocks (top-k's counts), a partial last bucket, a matrix."""
    plugin = make(name, **params)
    tensors = {"w": torch.randn(2, 35_000, generator=torch.Generator().manual_seed(3)), "b": torch.randn(7)}
    encoded = plugin.encode(update(tensors), ctx())
    decoded = plugin.decode(encoded, ctx(side="server")).tensors
    assert {k: v.shape for k, v in decoded.items()} == {k: v.shape for k, v in tensors.items()}
    unchecked = {k: plugin.codec.decompress({p.rpartition(".__")[2]: v for p, v in encoded.tensors.items()
                                             if p.startswith(k + ".__") and not p.endswith("layout")}, tuple(t.shape))
                 for k, t in tensors.items() if k + ".__layout" in encoded.tensors}
    assert all(torch.equal(decoded[k], v) for k, v in unchecked.items())


CODECS = [("topk", {"ratio": 0.05}), ("randk", {"ratio": 0.05}), ("qsgd", {"levels": 7, "bucket": 64}),
          ("qsgd", {"bucket": 64}), ("quantize", {"bucket": 64}), ("quantize", {"dtype": "float16"}),
          ("powersgd", {"rank": 2})]


def _noise(like: torch.Tensor, size: int, g: torch.Generator) -> torch.Tensor:
    if like.is_floating_point():
        return torch.randn(size, generator=g).to(like.dtype)
    info = torch.iinfo(like.dtype)
    return torch.randint(max(info.min, -(1 << 31)), min(info.max, (1 << 31) - 1), (size,), generator=g).to(like.dtype)


@settings(max_examples=150, deadline=None)
@given(codec=st.sampled_from(CODECS), rows=st.integers(1, 40), cols=st.integers(1, 3_000),
       mutation=st.sampled_from(["none", "resize", "refill", "drop", "layout"]), size=st.integers(0, 300),
       seed=st.integers(0, 2**31 - 1))
def test_any_mutated_codec_payload_is_decoded_to_its_layout_or_refused(
    codec: tuple[str, dict], rows: int, cols: int, mutation: str, size: int, seed: int
) -> None:
    """An honest payload with one field resized, refilled with random values, dropped, or its
    layout changed decodes to tensors of its layout's shape or raises ValueError, nothing else."""
    name, params = codec
    plugin = make(name, **params)
    g = torch.Generator().manual_seed(seed)
    tensors = dict(plugin.encode(update({"w": torch.randn(rows, cols, generator=g)}), ctx()).tensors)
    fields = sorted(k for k in tensors if k != "w.__layout")
    target = fields[seed % len(fields)] if fields else None
    if mutation == "resize" and target:
        tensors[target] = _noise(tensors[target], size, g)
    elif mutation == "refill" and target:
        tensors[target] = _noise(tensors[target], tensors[target].numel(), g).reshape(tensors[target].shape)
    elif mutation == "drop" and target:
        del tensors[target]
    elif mutation == "layout" and "w.__layout" in tensors:
        tensors["w.__layout"] = torch.tensor([0, size, seed % 7], dtype=torch.int32)
    try:
        out = plugin.decode(update(tensors), ctx(side="server")).tensors
    except ValueError:
        return
    if "w.__layout" in tensors:
        assert tuple(out["w"].shape) == tuple(tensors["w.__layout"].tolist()[1:])
