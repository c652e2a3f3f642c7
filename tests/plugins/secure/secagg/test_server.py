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
from fedweave.plugins.secure.secagg.messages import read_shares, share_bytes
from fedweave.plugins.secure.shamir import PRIME
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
    from fedweave.plugins.secure.secagg.server import _enough

    plugin, _, _, _ = masked_round(4)  # t = 3
    with pytest.raises(RoundError, match=r"^secagg: only 2 of client 4's share holders survived, its record key needs 3 \(threshold\); the sum cannot be unmasked$"):
        _enough(4, 2, 3, True, "survived")
    with pytest.raises(RoundError, match=r"^secagg: only 1 of client 2's share holders answered, its self-mask seed needs 3"):
        plugin._recover(1, 2, [(1, (0, 0))], False, set())
    with pytest.raises(RoundError, match=r"^secagg: only 0 of client 3's share holders answered, its record key needs 3"):
        plugin._recover(1, 3, None, True, set())


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
        "round 1: client 0's unmasking answer refused: secagg unmask: expected seed of torch.uint8 (6, 64), got torch.int32 (1,)"
    ]


def shifted(answer: Control, tensor: str, row: int) -> Control:
    """``answer`` with the share in row ``row`` of its ``tensor`` moved by one: still a value of GF(Q), so
    any threshold of shares with it interpolates to some secret (\"consistent\"), the wrong one."""
    rows = answer.tensors[tensor].clone()
    (value, blinding), = read_shares(bytes(rows[row].numpy()))
    rows[row] = torch.frombuffer(bytearray(share_bytes([((value + 1) % PRIME, blinding)])), dtype=torch.uint8)
    return Control("secagg", "unmask", {**answer.tensors, tensor: rows})


def test_a_shifted_unmasking_share_is_found_its_holder_named_and_left_out(caplog: pytest.LogCaptureFixture) -> None:
    """A holder that answers a shifted share of a survivor's self-mask seed used to move the seed
    rebuilt, so the server removed the wrong mask: accuracy fell to 0.10 with 5/5 accepted and no log
    line. The rebuilt secret fails its dealer's commitment; each share is then checked, the holder
    named and its shares left out, and the others rebuild the sum."""
    plugin, fed, plain, masked = masked_round(5)  # t = 3 of 5

    def lying(bodies: dict[int, Control]) -> dict[int, Control]:
        answers = fed.exchange(bodies)
        if next(iter(bodies.values())).step == "unmask":
            answers[0] = shifted(answers[0], "seed", 1)  # its share of client 1's self-mask seed
        return answers

    server = ctx(1, -1, "server")
    with caplog.at_level(logging.WARNING):
        result = plugin.decode(plugin.combine(masked, server, lying), server).tensors
    assert_mean_within_quantization(result, plain, plugin)
    assert [r.getMessage() for r in caplog.records] == [
        "round 1: client 0 revealed a share of client 1's self-mask seed that does not match its commitments; "
        "its shares are left out"
    ]
    assert plugin.metrics() == {"secagg_excluded": 1.0}


def test_shifted_shares_from_every_holder_skip_the_round_naming_them() -> None:
    plugin, fed, _, masked = masked_round(4, lost={"train": {3}})

    def forged(bodies: dict[int, Control]) -> dict[int, Control]:
        answers = fed.exchange(bodies)
        if next(iter(bodies.values())).step == "unmask":
            answers = {u: shifted(a, "key", 0) for u, a in answers.items()}  # shares of client 3's record key
        return answers

    with pytest.raises(RoundError, match=r"^secagg: only 0 of client 3's share holders answered with valid shares, its record key needs 3"):
        plugin.combine(masked, ctx(1, -1, "server"), forged)


def test_random_bytes_as_sealed_shares_exclude_their_sender_not_the_round(caplog: pytest.LogCaptureFixture) -> None:
    """Client 0 answers random bytes for the shares it seals to each neighbour. Every honest client
    aborted at the forward step (round skipped, 0 of 5); now each refuses client 0's shares and names
    it, client 0 is left with no holder of its shares and leaves before anyone masks with it, and the
    four others complete the round."""
    plugin = make("secagg", clients=5)
    fed = Federation(plugin)

    def garbage(bodies: dict[int, Control]) -> dict[int, Control]:
        answers = fed.exchange(bodies)
        if next(iter(bodies.values())).step == "share":
            noise = torch.randint(0, 256, answers[0].tensors["shares"].shape, dtype=torch.uint8)
            answers[0] = Control("secagg", "share", {**answers[0].tensors, "shares": noise})
        return answers

    with caplog.at_level(logging.WARNING):
        ready = plugin.setup(1, list(range(5)), garbage)
    assert ready == [1, 2, 3, 4] and plugin.metrics() == {"secagg_excluded": 1.0}
    for v in (1, 2, 3, 4):
        assert f"client {v} refused client 0's shares" in caplog.text
    assert "clients [0] leave secure aggregation: too few neighbours hold valid shares of it" in caplog.text
    plain = [update(model_tensors(i, scale=0.5), num_examples=10 + i, client_id=i) for i in ready]
    masked = [plugin.encode(u, fed.ctx(u.client_id)) for u in plain]
    assert_mean_within_quantization(unmask(plugin, fed, masked), plain, plugin)


def test_a_share_that_is_not_on_its_dealers_polynomial_is_refused_by_its_holder(caplog: pytest.LogCaptureFixture) -> None:
    """A dealer that seals a holder a share off the polynomial it committed to (it opens, so it passes
    the channel's authentication) is refused by that holder, named, and the pair does not mask."""
    plugin = make("secagg", clients=4)
    fed = Federation(plugin)

    def off(bodies: dict[int, Control]) -> dict[int, Control]:
        answers = fed.exchange(bodies)
        if next(iter(bodies.values())).step == "share":  # client 0 commits to other polynomials than it dealt
            other = answers[1].tensors["commitments"]
            answers[0] = Control("secagg", "share", {**answers[0].tensors, "commitments": other})
        return answers

    with caplog.at_level(logging.WARNING):
        assert plugin.setup(1, list(range(4)), off) == [1, 2, 3]
    assert "client 1 refuses client 0's shares: secagg: the share from client 0 does not match its commitments" in caplog.text


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
        "round 4: client 2 leaves secure aggregation: secagg share: expected shares of torch.uint8 (2, 144), got nothing"
    ]
