"""random-k's positions: the head of torch's seeded randperm, drawn without the whole
permutation, equal to torch's own for every size, ratio and seed; and its decode and error
feedback equal, bit for bit, to the plain index writes they replace."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import pytest
import torch

from fedweave.plugins.contracts import PluginContext
from fedweave.plugins.compression.randk import HEAD_FROM, RandKCodec, RandKHParams, fisher_yates_head, randperm_head
from fedweave.plugins.compression.wire import Site

from ..helpers import make, update
from ..secure.secagg.rounds import Federation
from .reference import same


def torch_head(seed: int, n: int, k: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed), dtype=dtype)[:k]


def test_a_hand_shuffled_permutation_of_five() -> None:
    # MT19937 seeded with 0 starts 2357136044, 2546248239, 3071714933, 3626093760 (init_genrand);
    # step i swaps a[i] with a[i + r_i % (5 - i)]: r_i % (5 - i) = 4, 3, 2, 0, so from [0, 1, 2, 3, 4]
    # a[0]<->a[4]: [4, 1, 2, 3, 0]; a[1]<->a[4]: [4, 0, 2, 3, 1]; a[2]<->a[4]: [4, 0, 1, 3, 2]; a[3] stays
    assert [2357136044 % 5, 2546248239 % 4, 3071714933 % 3, 3626093760 % 2] == [4, 3, 2, 0]
    assert fisher_yates_head(0, 5, 5).tolist() == [4, 0, 1, 3, 2] == torch_head(0, 5, 5).tolist()


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 33, 100, 1000])
def test_every_head_of_small_permutations(n: int) -> None:
    for seed in range(40):
        whole = torch_head(seed, n, n)
        for k in {k for k in (1, 2, n // 3, n // 2, n - 1, n) if 1 <= k <= n}:
            assert np.array_equal(fisher_yates_head(seed, n, k), whole[:k].numpy()), (seed, n, k)


@pytest.mark.parametrize("n,k", [(100352, 10035), (100352, 100352), (70000, 69000), (20000, 19999), (40000, 20000)])
def test_large_heads_many_colliding(n: int, k: int) -> None:
    # k close to n: nearly every target is aimed at more than once, long chains of earlier steps
    for seed in range(3):
        assert np.array_equal(fisher_yates_head(seed, n, k), torch_head(seed, n, k).numpy()), (seed, n, k)


def test_keys_past_32_bits() -> None:
    # (target, step) no longer fits 32 bits: n << bits(k) >= 2**32
    n, k = 300_000, 30_000
    assert n << (k - 1).bit_length() >= 1 << 32
    for seed in (5, 6):
        assert np.array_equal(fisher_yates_head(seed, n, k), torch_head(seed, n, k).numpy())


@pytest.mark.parametrize("seed", [0, 1, 2**32 - 1, 2**32, 2**32 + 7, 2**63 - 1, 2**64 - 1, -1, -(2**32) - 3, -(2**63)])
def test_seeds_torch_takes_mod_2_to_the_32(seed: int) -> None:
    assert np.array_equal(fisher_yates_head(seed, 100352, 10035), torch_head(seed, 100352, 10035).numpy())


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("n,ratio", [(1, 1.0), (10, 0.1), (1280, 0.1), (HEAD_FROM - 1, 0.1), (HEAD_FROM, 0.1), (100352, 0.1),
                                     (100352, 0.125), (100352, 0.13), (100352, 0.01), (100352, 1.0), (250_000, 0.05)])
def test_randperm_head_is_torchs_whichever_way_it_draws(n: int, ratio: float, dtype: torch.dtype) -> None:
    k = max(1, int(ratio * n))
    for seed in (11, 2**62 + 3):
        head = randperm_head(seed, n, k, dtype)
        assert head.dtype == dtype and head.is_contiguous()
        assert torch.equal(head, torch_head(seed, n, k, dtype))


def test_the_benchmarks_tensor_takes_the_fast_way(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("randperm drew the whole permutation")

    expected = torch_head(3, 100352, 10035, torch.int32)
    monkeypatch.setattr(torch, "randperm", refuse)
    assert torch.equal(randperm_head(3, 100352, 10035, torch.int32), expected)


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_a_seed_torch_refuses_is_refused_as_before(seed: int) -> None:
    with pytest.raises(ValueError, match="Overflow"):
        torch_head(seed, 100352, 10035)
    with pytest.raises(ValueError, match="Overflow"):
        randperm_head(seed, 100352, 10035, torch.int32)


def test_threads_draw_their_own_streams() -> None:
    seeds = list(range(64))
    with ThreadPoolExecutor(4) as pool:
        heads = list(pool.map(lambda s: fisher_yates_head(s, 50_000, 5_000), seeds))
    for seed, head in zip(seeds, heads):
        assert np.array_equal(head, torch_head(seed, 50_000, 5_000).numpy())


def awkward(n: int, seed: int) -> torch.Tensor:
    """Values with signed zeros, infinities and NaNs among ordinary ones."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    x[::7] = 0.0
    x[1::7] = -0.0
    x[2::11] = float("inf")
    x[3::13] = float("-inf")
    x[4::17] = float("nan")
    return x


@pytest.mark.parametrize("n,ratio", [(100352, 0.1), (1280, 0.1), (10, 0.1)])
def test_decode_is_the_index_write_bit_for_bit(n: int, ratio: float) -> None:
    codec = RandKCodec(RandKHParams(ratio=ratio))
    values = awkward(codec.k(n), 1)
    seed = 99
    fields = {"values": values, "seed": torch.tensor([seed])}
    expected = torch.zeros(n)
    expected[torch_head(seed, n, codec.k(n))] = values
    out = codec.decompress(fields, (n,))
    assert same(out, expected)


@pytest.mark.parametrize("n,ratio,feedback", [(100352, 0.1, True), (1280, 0.5, True), (10, 0.1, True), (1280, 0.5, False)])
def test_the_rest_kept_is_x_less_what_was_sent_bit_for_bit(n: int, ratio: float, feedback: bool) -> None:
    """With error feedback the values go unscaled and leave x - x there (0, or NaN for ±inf);
    without, the rest is x less the scaled values, as decompress would give them."""
    codec = RandKCodec(RandKHParams(ratio=ratio, error_feedback=feedback))
    x = awkward(n, 2)
    original = x.clone()
    site = Site("randk", 0, "up", 1, 4, "w")
    [fields] = codec.compress_keeping_rest([x], [site])
    plain = codec.compress(original, site)
    assert torch.equal(fields["seed"], plain["seed"]) and same(fields["values"], plain["values"])
    positions = torch_head(int(fields["seed"].item()), n, codec.k(n))
    expected = original.clone()
    expected[positions] = original[positions] - fields["values"]
    assert same(x, expected)
    assert same(x, original - codec.decompress(fields, (n,)))


def test_the_codec_sends_the_values_at_torchs_positions() -> None:
    codec = RandKCodec(RandKHParams(ratio=0.1))
    x = torch.randn(128, 784)
    site = Site("randk", 0, "up", 1, 4, "w")
    fields = codec.compress(x, site)
    positions = torch_head(int(fields["seed"].item()), x.numel(), 10035)
    assert torch.equal(fields["values"], x.reshape(-1)[positions] * (x.numel() / 10035))


def test_one_clients_seed_does_not_move_the_positions_of_a_securely_summed_round() -> None:
    """With shared_indices the clients' values are summed where they lie (secure aggregation),
    and the seeds, sent in the clear, are combined by their maximum: a client that sent a larger
    seed than the round's would place every client's values, at positions no honest encoder of
    the round draws. The server decodes at the round's own positions, whatever seed arrived."""
    secagg, randk = make("secagg", clients=3), make("randk", ratio=0.25, shared_indices=True)
    g = torch.Generator().manual_seed(0)
    plain = [update({"w": torch.randn(40, generator=g).clamp(-1, 1)}, client_id=i) for i in range(3)]
    server = PluginContext(1, -1, "server")
    decoded, seeds = [], []
    for forged in (None, (1 << 63) - 1):
        fed = Federation(secagg)
        secagg.setup(1, [0, 1, 2], fed.exchange)
        masked = []
        for u in plain:
            encoded = randk.encode(u, fed.ctx(u.client_id))
            seeds.append(int(encoded.tensors["w.__seed"]))
            if forged is not None and u.client_id == 2:
                encoded = replace(encoded, tensors={**encoded.tensors, "w.__seed": torch.tensor([forged])})
            masked.append(secagg.encode(encoded, fed.ctx(u.client_id)))
        combined = secagg.decode(secagg.combine(masked, server, fed.exchange), server)
        assert (int(combined.tensors["w.__seed"]) == forged) == (forged is not None)  # the largest seed came through
        decoded.append(randk.decode(combined, server).tensors["w"])
    assert len(set(seeds)) == 1  # the round's, drawn by every client
    assert decoded[0].nonzero().view(-1).tolist() == sorted(torch_head(seeds[0], 40, 10).tolist())
    assert torch.equal(decoded[1].nonzero(), decoded[0].nonzero())
