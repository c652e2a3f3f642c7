"""Secure aggregation: Shamir sharing, the sum within quantization error, masking, drop-outs."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import assert_same_params, run_to_end, small_config
from fedweave import runner
from fedweave.errors import RoundError
from fedweave.plugins.secure import shamir
from fedweave.plugins.secure.secagg import MASKED
from fedweave.strategies.aggregate import weighted_average
from fedweave.transports.base import Exchange

from .helpers import ctx, make, model_tensors, update


def test_shamir_recovers_from_any_threshold_of_shares_and_not_fewer() -> None:
    secret = int.from_bytes(bytes(range(32)), "big")
    shares = shamir.split(secret, 4, list(range(1, 8)))
    for subset in ([1, 2, 3, 4], [7, 5, 3, 1], [2, 4, 6, 7, 5]):
        assert shamir.combine([shares[x] for x in subset]) == secret
    assert shamir.combine([shares[x] for x in (1, 2, 3)]) != secret


def masked_round(n: int, rnd: int = 1, seed: int = 0, **params: object) -> tuple:
    """n clients of a round: the plugin after set-up, their plaintext updates, their masked ones."""
    plugin = make("secagg", clients=n, **params)
    plugin.begin_round(rnd, list(range(n)))
    plain = [update(model_tensors(seed + i, scale=0.5), num_examples=10 + 7 * i, client_id=i) for i in range(n)]
    masked = [plugin.encode(u, ctx(rnd, u.client_id)) for u in plain]
    return plugin, plain, masked


def unmask(plugin, masked: list, rnd: int = 1) -> dict[str, torch.Tensor]:
    server = ctx(rnd, -1, "server")
    return plugin.decode(plugin.combine(masked, server), server).tensors


def assert_mean_within_quantization(result: dict, plain: list, plugin) -> None:
    expected = weighted_average([u.tensors for u in plain], [u.num_examples for u in plain])
    step = 2 * plugin.hp.clip_range / plugin.levels  # one quantization step of a single update
    assert result.keys() == expected.keys()
    for k, v in expected.items():
        if v.is_floating_point():
            assert (result[k] - v).abs().max().item() <= step
            assert result[k].dtype == v.dtype
        else:
            assert torch.equal(result[k], v)


def test_the_sum_equals_the_plaintext_weighted_mean_within_quantization_error() -> None:
    plugin, plain, masked = masked_round(5)
    assert_mean_within_quantization(unmask(plugin, masked), plain, plugin)
    assert all(set(m.tensors) >= {MASKED} and m.tensors[MASKED].dtype == torch.int32 for m in masked)


def test_secagg_plus_neighbourhoods_are_symmetric_and_sparse() -> None:
    plugin = make("secagg", neighbours=4, clients=30)
    graph = plugin.graph(3, list(range(30)))
    assert all(len(nb) == 4 and u not in nb for u, nb in graph.items())
    assert all(u in graph[v] for u, nb in graph.items() for v in nb)
    assert graph != plugin.graph(4, list(range(30)))  # a new random ring every round
    plugin, plain, masked = masked_round(12, neighbours=4)
    assert_mean_within_quantization(unmask(plugin, masked), plain, plugin)


def test_a_masked_update_is_uniform_and_uncorrelated_with_the_plaintext() -> None:
    plugin, plain, masked = masked_round(4, bits=32)
    field = plugin.field
    values = field.from_wire(masked[0].tensors[MASKED]).astype(np.float64) / 2**32
    x = torch.cat([t.reshape(-1) for t in plain[0].tensors.values() if t.is_floating_point()]).numpy()
    counts = np.histogram(values, bins=16, range=(0, 1))[0]
    expected = len(values) / 16
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 37.7  # 15 degrees of freedom, p = 0.001
    assert abs(np.corrcoef(values, x)[0, 1]) < 4 / np.sqrt(len(x))
    # the same update masked in another round looks unrelated to the first masking
    again = make("secagg", clients=4)
    again.begin_round(2, [0, 1, 2, 3])
    other = field.from_wire(again.encode(plain[0], ctx(2, 0)).tensors[MASKED]).astype(np.float64) / 2**32
    assert abs(np.corrcoef(values, other)[0, 1]) < 4 / np.sqrt(len(x))


def test_ten_clients_threshold_six_three_drop_after_masking_the_survivors_sum_is_recovered() -> None:
    plugin, plain, masked = masked_round(10, threshold=0.6)
    assert plugin.setup.threshold[0] == 6
    survivors = [m for m in masked if m.client_id not in (2, 5, 9)]
    result = unmask(plugin, survivors)
    assert_mean_within_quantization(result, [u for u in plain if u.client_id not in (2, 5, 9)], plugin)


def test_ten_clients_threshold_six_five_drop_the_round_aborts() -> None:
    plugin, _, masked = masked_round(10, threshold=0.6)
    with pytest.raises(RoundError, match=r"only 5 of client 5's share holders survived, its self-mask seed needs 6"):
        plugin.combine(masked[5:], ctx(1, -1, "server"))


def test_an_update_from_outside_the_cohort_or_before_set_up_is_refused() -> None:
    plugin, plain, _ = masked_round(3)
    with pytest.raises(ValueError, match="not in round 1's secure-aggregation cohort"):
        plugin.encode(update(model_tensors(), client_id=7), ctx(1, 7))
    with pytest.raises(ValueError, match="no key set-up for round 2"):
        plugin.encode(plain[0], ctx(2, 0))


def test_a_round_whose_examples_could_wrap_the_field_aborts() -> None:
    plugin, plain, _ = masked_round(3, max_examples=40)  # 10 + 17 + 24 = 51 examples together
    masked = [plugin.encode(u, ctx(1, u.client_id)) for u in plain]
    with pytest.raises(RoundError, match="more than max_examples=40"):
        plugin.combine(masked, ctx(1, -1, "server"))


def test_a_secagg_run_equals_plain_fedavg_within_quantization(tmp_path: Path) -> None:
    plain, _ = run_to_end(tmp_path / "plain")
    secure, records = run_to_end(tmp_path / "secure", "plugins.client_send=[{name: secagg, bits: 48}]")
    assert_same_params(plain, secure, atol=1e-5)
    assert all(not r["skipped"] for r in records)


class DropAfterMasking:
    """A topology whose replies from some clients are lost after the clients masked them."""

    def __init__(self, inner, lost: set[int]):
        self.inner, self.lost = inner, lost

    def exchange(self, messages, timeout):
        result = self.inner.exchange(messages, timeout)
        kept = Exchange(bytes_sent=result.bytes_sent, bytes_received=result.bytes_received, failures=result.failures)
        for reply in result.replies:
            if reply.client_id in self.lost and reply.round == 1:
                kept.failures[reply.client_id] = "connection lost"
            else:
                kept.replies.append(reply)
        return kept

    def close(self):
        self.inner.close()


@pytest.mark.parametrize("lost,skipped", [({1, 4, 8}, False), ({0, 2, 4, 6, 8}, True)])
def test_in_a_run_drop_outs_are_recovered_or_skip_the_round(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, lost: set[int], skipped: bool
) -> None:
    config = small_config("clients=10", "rounds=2", "plugins.client_send=[{name: secagg, threshold: 0.6}]")
    r = runner.prepare(config, tmp_path / "run")
    r.parts.topology = DropAfterMasking(r.parts.topology, lost)
    start = {k: v.clone() for k, v in r.params.items()}
    with caplog.at_level(logging.ERROR):
        records = runner.execute(r)
    assert records[0]["skipped"] is skipped and records[0]["clients_completed"] == 10 - len(lost)
    assert records[1]["skipped"] is False
    if skipped:
        assert "round 1 skipped: secagg: only 5 of client" in caplog.text
    moved = any(not torch.equal(start[k], v) for k, v in r.params.items())
    assert moved  # round 2 always trains
