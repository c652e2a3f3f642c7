"""SecAgg's client half: its answers to each step, the refusals of malformed or out-of-turn
requests, one secret per owner revealed once, its rounding noise and its clipping warning."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from conftest import small_config
from fedweave.errors import ConfigError, RoundError
from fedweave.plugins.contracts import PluginContext
from fedweave.plugins.secure.secagg import MASKED
from fedweave.types import Control

from ...helpers import make, update
from .rounds import Federation, masked_round, unmask


def rounded_sum(**params: Any) -> torch.Tensor:
    """The unmasked sum of two clients whose 2,000 entries each lie half a step between two
    levels: each entry's rounding is a fair coin, so the sum shows the rounding drawn."""
    plugin = make("secagg", clients=2, clip_range=1.0, **params)
    fed = Federation(plugin)
    plugin.setup(1, [0, 1], fed.exchange)
    value = -1 + 1000.5 * 2 / plugin.levels
    ups = [update({"w": torch.full((2000,), value)}, num_examples=1, client_id=u) for u in (0, 1)]
    return unmask(plugin, fed, [plugin.encode(u, fed.ctx(u.client_id)) for u in ups])["w"]


def test_stochastic_rounding_comes_from_the_secure_source_unless_a_simulation_seeds_it() -> None:
    """By default the rounding is fresh in every run, so the server cannot draw it again from
    the config; ``seeded_noise: true`` repeats it bit for bit, and is refused where the nodes
    run apart (as DP's seeded noise)."""
    assert not torch.equal(rounded_sum(), rounded_sum())  # 4,000 fair coins drawn twice alike: p = 2^-4000
    assert torch.equal(rounded_sum(seeded_noise=True), rounded_sum(seeded_noise=True))
    assert not torch.equal(rounded_sum(seeded_noise=True, seed=0), rounded_sum(seeded_noise=True, seed=1))
    seeded = "plugins.client_send=[{name: secagg, seeded_noise: true}]"
    assert small_config(seeded).plugins.client_send[0].params.seeded_noise
    with pytest.raises(ConfigError, match=r"^config key 'plugins.client_send\[0\].seeded_noise': plugin 'secagg'.*transport 'grpc'"):
        small_config(seeded, "transport=grpc", "launcher=process")


def test_a_client_reveals_one_secret_per_owner_and_only_once() -> None:
    plugin, fed, _, masked = masked_round(6, threshold=0.6)
    request = Control("secagg", "unmask", {"survivors": torch.tensor([1, 2, 3, 4], dtype=torch.int32)})
    answer = plugin.answer(request, fed.ctx(0))  # client 5 dropped: a share of its record key
    assert answer.tensors["seed"].shape == (5, 64) and answer.tensors["key"].shape == (1, 64)
    with pytest.raises(ValueError, match="client 0 has no secure-aggregation set-up for round 1"):
        plugin.answer(request, fed.ctx(0))  # a second request could ask for the other secret
    too_few = Control("secagg", "unmask", {"survivors": torch.tensor([0], dtype=torch.int32)})
    with pytest.raises(ValueError, match="only 1 neighbours survived, fewer than the threshold 4"):
        plugin.answer(too_few, fed.ctx(1))
    two = Control("secagg", "unmask", {"survivors": torch.tensor([0, 3], dtype=torch.int32)})
    with pytest.raises(ValueError, match="only 2 neighbours survived, fewer than the threshold 4"):  # 2 + itself < t
        plugin.answer(two, fed.ctx(2))


def test_a_tampered_share_is_refused_by_its_receiver_who_names_its_sender(caplog: pytest.LogCaptureFixture) -> None:
    """A sealed share that does not open used to make its receiver abort (and so every receiver, for
    random bytes from one sender); the receiver now refuses that sender's shares, names it, and the
    pair does not mask: every client stays, client 2 masks with 1 and 3 only."""
    plugin = make("secagg", clients=4)
    fed = Federation(plugin)

    def tamper(bodies: dict[int, Control]) -> dict[int, Control]:
        if bodies and next(iter(bodies.values())).step == "forward":
            bodies[2].tensors["shares"] = bodies[2].tensors["shares"].clone()
            bodies[2].tensors["shares"][0, 5] ^= 1
        return fed.exchange(bodies)

    with caplog.at_level(logging.WARNING):
        assert plugin.setup(1, [0, 1, 2, 3], tamper) == [0, 1, 2, 3]
    assert "client 2 refuses client 0's shares: secagg: the share from client 0 does not authenticate" in caplog.text
    assert plugin.round.neighbours == {0: (1, 3), 1: (0, 2, 3), 2: (1, 3), 3: (0, 1, 2)}
    assert plugin.instruct(PluginContext(1, 2, "server")) == {"secagg.masking": [1, 3]}


def test_a_client_masks_only_with_whom_the_server_names_among_the_shares_it_verified() -> None:
    other = make("secagg", clients=4)
    fed2 = Federation(other)
    other.setup(1, [0, 1, 2, 3], fed2.exchange)
    payload = update({"w": torch.zeros(10)}, client_id=0)
    for config, error in [
        ({}, "is not a list of client ids"),
        ({"secagg.masking": [2, 1]}, "names clients it holds no verified share of"),
        ({"secagg.masking": [1, 5]}, "names clients it holds no verified share of"),
        ({"secagg.masking": [1]}, "fewer than the threshold 3"),
    ]:
        with pytest.raises(ValueError, match=error):
            other.encode(payload, PluginContext(1, 0, "client", fed2.states[0], config))
    assert MASKED in other.encode(payload, fed2.ctx(0)).tensors


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (Control("secagg", "share", {}), "expected the cohort|expected cohort"),
        (Control("secagg", "share", {"cohort": torch.tensor([2, 1], dtype=torch.int32)}), "sorted list"),
        (Control("secagg", "share", {"cohort": torch.tensor([1, 2], dtype=torch.int32)}), "not in the cohort"),
        (
            Control("secagg", "share", {"cohort": torch.tensor([0, 1], dtype=torch.int32), "keys": torch.zeros(2, 32, dtype=torch.uint8)}),
            r"expected keys of torch.uint8 \(1, 32\)",
        ),
        (Control("secagg", "unmask", {}), "is at secagg step 'advertise' of round 1, not 'masked'"),
        (Control("secagg", "reboot", {}), "no step 'reboot'"),
    ],
)
def test_a_malformed_control_message_is_refused_with_a_reason(body: Control, error: str) -> None:
    plugin = make("secagg", clients=4)
    state: dict[str, Any] = {}
    plugin.answer(Control("secagg", "advertise"), PluginContext(1, 0, "client", state))
    with pytest.raises(ValueError, match=error):
        plugin.answer(body, PluginContext(1, 0, "client", state))


def test_a_client_answers_only_about_its_neighbours() -> None:
    plugin, fed, _, masked = masked_round(8, neighbours=4)
    u = masked[0].client_id
    strangers = [v for v in range(8) if v != u and v not in plugin.round.neighbours[u]]
    request = Control("secagg", "unmask", {"survivors": torch.tensor(strangers[:3], dtype=torch.int32)})
    with pytest.raises(ValueError, match="survivors is not a sorted list of distinct expected client ids"):
        plugin.answer(request, fed.ctx(u))


def test_a_client_warns_when_more_than_one_percent_of_its_update_is_clipped(caplog: pytest.LogCaptureFixture) -> None:
    plugin = make("secagg", clients=3, clip_range=1.0)
    fed = Federation(plugin)
    plugin.setup(1, [0, 1, 2], fed.exchange)

    def send(u: int, values: list[float]) -> None:
        w = torch.zeros(200)
        w[: len(values)] = torch.tensor(values)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            plugin.encode(update({"w": w}, client_id=u), fed.ctx(u))

    send(0, [-1.5, -2.0, -7.0])  # 3 of 200 below −R: 1.5 %
    assert [r.getMessage() for r in caplog.records] == ["secagg: client 0 clipped 3 of 200 entries to ±1 (raise clip_range)"]
    send(1, [1.5, -2.0, 1.0, -1.0, 1.0])  # 2 beyond ±R (the entries at ±R are not clipped): 1 %, no warning
    assert caplog.text == ""
    with pytest.raises(ValueError, match=r"^client 2 holds 65537 examples, more than secagg's max_examples=65536$"):
        plugin.encode(update({"w": torch.zeros(200)}, num_examples=65537, client_id=2), fed.ctx(2))
    plugin.encode(update({"w": torch.zeros(200)}, num_examples=65536, client_id=2), fed.ctx(2))  # at the bound: sent


def test_malformed_set_up_messages_are_refused_with_what_was_expected() -> None:
    plugin = make("secagg", clients=4)
    state: dict[str, Any] = {}
    plugin.answer(Control("secagg", "advertise"), PluginContext(1, 0, "client", state))
    cohort = torch.tensor([0, 1], dtype=torch.int32)
    cases = [
        ({"cohort": cohort, "keys": torch.zeros(1, 32, dtype=torch.int32)}, r"expected keys of torch.uint8 \(1, 32\), got torch.int32 \(1, 32\)"),
        ({"cohort": cohort}, r"expected keys of torch.uint8 \(1, 32\), got nothing$"),
        ({"cohort": torch.tensor([0, 1], dtype=torch.int64)}, r"^secagg share: expected cohort as a 1-d int32 tensor$"),
    ]
    for tensors, error in cases:
        with pytest.raises(ValueError, match=error):
            plugin.answer(Control("secagg", "share", tensors), PluginContext(1, 0, "client", state))
    other = make("secagg", clients=4)
    twins: dict[str, Any] = {}
    key = other.answer(Control("secagg", "advertise"), PluginContext(1, 1, "client", twins)).tensors["key"]
    three = torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^secagg share: the neighbours' public keys are not distinct$"):
        plugin.answer(Control("secagg", "share", {"cohort": three, "keys": torch.cat([key, key])}), PluginContext(1, 0, "client", state))


def test_a_client_takes_shares_only_from_its_neighbours_and_only_enough_of_them(caplog: pytest.LogCaptureFixture) -> None:
    """Forwarding: senders must be neighbours of the receiver, and at least t − 1 of them."""
    plugin = make("secagg", clients=8, neighbours=4)  # t = 3 of 5
    fed = Federation(plugin)
    seen: dict[int, Control] = {}

    def keep(bodies: dict[int, Control]) -> dict[int, Control]:
        if next(iter(bodies.values())).step == "forward":
            seen.update(bodies)
            return {}
        return fed.exchange(bodies)

    with pytest.raises(RoundError, match=r"^secagg: 0 client\(s\) completed the key set-up; secure aggregation needs 2$"):
        plugin.setup(1, list(range(8)), keep)
    graph = plugin.graph(1, list(range(8)))
    body = seen[0]
    senders = body.tensors["senders"].tolist()
    stranger = next(v for v in range(1, 8) if v not in graph[0])
    wrong = dict(body.tensors, senders=torch.tensor(sorted([*senders[1:], stranger]), dtype=torch.int32))
    with pytest.raises(ValueError, match="senders is not a sorted list of distinct expected client ids"):
        plugin.answer(Control("secagg", "forward", wrong), fed.ctx(0))
    two = dict(body.tensors, senders=body.tensors["senders"][:2], shares=body.tensors["shares"][:2],
               commitments=body.tensors["commitments"][:2])
    assert plugin.answer(Control("secagg", "forward", two), fed.ctx(0)).step == "forward"  # 2 + itself = t: enough
    one = dict(seen[1].tensors, senders=seen[1].tensors["senders"][:1], shares=seen[1].tensors["shares"][:1],
               commitments=seen[1].tensors["commitments"][:1])
    with pytest.raises(ValueError, match=r"^secagg forward: only 1 neighbours completed the set-up, fewer than the threshold 3 of this client's neighbourhood$"):
        plugin.answer(Control("secagg", "forward", one), fed.ctx(1))
