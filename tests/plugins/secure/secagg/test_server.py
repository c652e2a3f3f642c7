"""SecAgg's server half: the key set-up's refusals, the combining's checks, the unmasking's
refusals and their messages, and no client secret ever reachable from it."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np
import pytest
import torch

from fedweave.errors import RoundError
from fedweave.types import Control

from ...helpers import ctx, make, model_tensors, update
from .rounds import Federation, assert_holds_none, assert_mean_within_quantization, masked_round, secret_values, unmask


def test_a_client_advertising_an_invalid_key_leaves_and_the_others_go_on(caplog: pytest.LogCaptureFixture) -> None:
    plugin = make("secagg", clients=4)
    fed = Federation(plugin)

    def low_order_key(bodies: dict[int, Control]) -> dict[int, Control]:
        answers = fed.exchange(bodies)
        if next(iter(bodies.values())).step == "advertise":
            answers[1] = Control("secagg", "advertise", {"key": torch.zeros(1, 32, dtype=torch.uint8)})
        return answers

    with caplog.at_level(logging.WARNING):
        assert plugin.setup(1, [0, 1, 2, 3], low_order_key) == [0, 2, 3]
    assert "client 1 leaves secure aggregation: its public key is not a valid X25519 point" in caplog.text


def test_a_round_whose_examples_could_wrap_the_field_aborts() -> None:
    plugin, fed, plain, masked = masked_round(3, max_examples=40)  # 10 + 17 + 24 = 51 examples together
    with pytest.raises(RoundError, match="more than max_examples=40"):
        plugin.combine(masked, ctx(1, -1, "server"), fed.exchange)


def test_the_server_half_holds_no_secret_of_any_client_at_any_step() -> None:
    plugin = make("secagg", clients=6, neighbours=2)
    fed = Federation(plugin)
    held: list[tuple[list[Any], list[bytes]]] = []

    def watched(bodies: dict[int, Control]) -> dict[int, Control]:
        answers = fed.exchange(bodies)
        held.append(secret_values(fed.states))
        assert_holds_none(plugin, *held[-1])
        return answers

    plugin.setup(1, list(range(6)), watched)
    plain = [update(model_tensors(i, scale=0.5), num_examples=10, client_id=i) for i in range(6)]
    masked = [plugin.encode(u, fed.ctx(u.client_id)) for u in plain]
    assert_holds_none(plugin, *secret_values(fed.states))
    assert_holds_none(plugin, *held[1])  # also the seeds and keys of the set-up, dropped since
    plugin.combine(masked, ctx(1, -1, "server"), watched)
    assert len(held) == 4 and all(values for _, values in held[:3])  # the clients did hold secrets
    assert held[3] == ([], [])  # and none after unmasking
    assert fed.states == {u: {} for u in range(6)}


def test_the_server_combines_only_distinct_members_and_up_to_max_examples_inclusive() -> None:
    plugin, fed, plain, masked = masked_round(3, max_examples=51)  # exactly 10 + 17 + 24 examples: allowed
    for bad in ([masked[0], masked[0], masked[1]], [masked[0], dataclasses.replace(masked[1], client_id=7)]):
        with pytest.raises(RoundError, match=r"^secagg: round 1's updates do not come from distinct members of its cohort$"):
            plugin.combine(bad, ctx(1, -1, "server"), fed.exchange)
    combined = plugin.combine(masked, ctx(1, -1, "server"), fed.exchange)
    assert combined.kind is plain[0].kind and combined.num_examples == 51
    assert_mean_within_quantization(plugin.decode(combined, ctx(1, -1, "server")).tensors, plain, plugin)
    with pytest.raises(ValueError, match=r"^secagg decodes only the server's combined sum, never one client's masked update$"):
        plugin.decode(masked[0], ctx(1, -1, "server"))


def test_a_dropped_clients_record_key_short_of_holders_is_named() -> None:
    from fedweave.plugins.secure.secagg.server import _enough, _recover

    with pytest.raises(RoundError, match=r"^secagg: only 2 of client 4's share holders survived, its record key needs 3 \(threshold\); the sum cannot be unmasked$"):
        _enough(4, 2, 3, True, "survived")
    with pytest.raises(RoundError, match=r"^secagg: only 1 of client 2's share holders answered, its self-mask seed needs 3"):
        _recover(2, [(1, np.zeros(8, np.int32))], 3, False)
    with pytest.raises(RoundError, match=r"^secagg: only 0 of client 5's share holders answered, its record key needs 1"):
        _recover(5, None, 1, True)


def test_a_malformed_unmasking_answer_is_logged_and_the_others_still_unmask(caplog: pytest.LogCaptureFixture) -> None:
    plugin, fed, plain, masked = masked_round(6, threshold=0.5)

    def garbled(bodies: dict[int, Control]) -> dict[int, Control]:
        answers = fed.exchange(bodies)
        if next(iter(bodies.values())).step == "unmask":
            answers[0] = Control("secagg", "unmask", {"seed": torch.zeros(1, dtype=torch.int32)})
        return answers

    server = ctx(1, -1, "server")
    with caplog.at_level(logging.WARNING):
        result = plugin.decode(plugin.combine(masked, server, garbled), server).tensors
    assert_mean_within_quantization(result, plain, plugin)  # the lowest id was refused: the next answers are read
    assert [r.getMessage() for r in caplog.records] == [
        "round 1: client 0's unmasking answer refused: secagg unmask: expected seed of torch.int32 (6, 8), got torch.int32 (1,)"
    ]


def test_inconsistent_or_forged_shares_skip_the_round_naming_the_client() -> None:
    plugin, fed, _, masked = masked_round(4, lost={"train": {3}})

    def forged(bodies: dict[int, Control]) -> dict[int, Control]:
        answers = fed.exchange(bodies)
        if next(iter(bodies.values())).step == "unmask":
            for u, a in answers.items():
                key = a.tensors["key"].clone()
                key[:, 0] = (key[:, 0] + 12345) % 65536  # a wrong share of client 3's record key
                answers[u] = Control("secagg", "unmask", {"seed": a.tensors["seed"], "key": key})
        return answers

    with pytest.raises(RoundError, match=r"^secagg: (client 3's shares are inconsistent \(.+\)|.*client 3's seed record.* with its rebuilt key)$"):
        plugin.combine(masked, ctx(1, -1, "server"), forged)


def test_a_round_needs_two_clients_to_advertise_and_two_is_enough(caplog: pytest.LogCaptureFixture) -> None:
    plugin, fed, plain, masked = masked_round(2)  # the smallest secure aggregation
    assert_mean_within_quantization(unmask(plugin, fed, masked), plain, plugin)
    lonely = make("secagg", clients=3)
    with pytest.raises(RoundError, match=r"^secagg: 1 client\(s\) advertised keys; secure aggregation needs 2$"):
        lonely.setup(1, [0, 1, 2], Federation(lonely, lost={"advertise": {1, 2}}).exchange)
    bad = make("secagg", clients=3)
    clients = Federation(bad)

    def malformed_share(bodies: dict[int, Control]) -> dict[int, Control]:
        answers = clients.exchange(bodies)
        if next(iter(bodies.values())).step == "share":
            answers[2] = Control("secagg", "share", {})
        return answers

    with caplog.at_level(logging.WARNING):
        assert bad.setup(4, [0, 1, 2], malformed_share) == [0, 1]
    assert [r.getMessage() for r in caplog.records] == [
        "round 4: client 2 leaves secure aggregation: secagg share: expected shares of torch.uint8 (2, 80), got nothing"
    ]
