"""The plugin chain: order of encoding and decoding, ``applied``, the identity plugin in a run, refusals."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from conftest import assert_same_params, comparable, run_to_end, small_config
from fedweave.errors import ConfigError
from fedweave.plugins.chain import Chain, Chains
from fedweave.plugins.contracts import Payload, PluginContext
from fedweave.plugins.identity import Identity, IdentityHParams
from fedweave.strategies.fedavg import FedAvg
from fedweave.types import Instruction, TaskKind, Update, UpdateKind, Work
from plugins.helpers import make
from plugins.helpers import update as plugin_update

CTX = PluginContext(round=1, client_id=0, side="server")


def mapped(payload: Update, fn: Callable[[torch.Tensor], torch.Tensor]) -> Update:
    return replace(payload, tensors={k: fn(v) for k, v in payload.tensors.items()})


class AddOne(Identity):
    name = "add_one"

    def encode(self, payload: Update, ctx: PluginContext) -> Update:
        return mapped(payload, lambda t: t + 1)

    def decode(self, payload: Update, ctx: PluginContext) -> Update:
        return mapped(payload, lambda t: t - 1)


class Double(Identity):
    name = "double"

    def encode(self, payload: Update, ctx: PluginContext) -> Update:
        return mapped(payload, lambda t: t * 2)

    def decode(self, payload: Update, ctx: PluginContext) -> Update:
        return mapped(payload, lambda t: t / 2)


def update(value: float = 3.0) -> Update:
    return Update(UpdateKind.DELTA, {"w": torch.tensor([value], dtype=torch.float64)}, num_examples=2)


def test_encode_applies_in_order_and_records_applied() -> None:
    original = update(3.0)
    encoded = Chain([AddOne(IdentityHParams()), Double(IdentityHParams())]).encode(original, CTX)
    assert encoded.tensors["w"].item() == (3.0 + 1) * 2
    assert encoded.applied == ["add_one", "double"]
    assert original.applied == [] and original.tensors["w"].item() == 3.0  # the sent payload is not changed


def test_decode_undoes_in_reverse_order() -> None:
    sender = Chain([AddOne(IdentityHParams()), Double(IdentityHParams())])
    receiver = Chain([Double(IdentityHParams()), AddOne(IdentityHParams())])  # configured order does not matter
    decoded = receiver.decode(sender.encode(update(3.0), CTX), CTX)
    # (3 + 1) · 2 = 8 undone last-first gives 3; undone first-first it would give (8 - 1) / 2 = 3.5
    assert decoded.tensors["w"].item() == 3.0
    assert decoded.applied == []


class Tells(Identity):
    name = "tells"

    def instruct(self, ctx: PluginContext) -> dict[str, object]:
        return {"tells.round": ctx.round}


def test_the_downlink_sends_as_is_only_without_a_plugin_that_instructs_or_encodes() -> None:
    ins = Instruction(3, TaskKind.TRAIN, Work(1, 4), {"w": torch.zeros(1)})
    ctx = PluginContext(3, 1, "server")
    assert Chains().sends_as_is and Chains().to_clients(ins, ctx) is ins
    assert Chains(client_send=Chain([AddOne(IdentityHParams())])).sends_as_is  # the uplink's: not the downlink
    encoding = Chains(server_send=Chain([Identity(IdentityHParams())]))
    assert not encoding.sends_as_is and encoding.to_clients(ins, ctx).applied == ["identity"]
    telling = Chains(client_send=Chain([Tells(IdentityHParams())]))
    assert not telling.sends_as_is and telling.to_clients(ins, ctx).config == {"tells.round": 3}


def test_receive_chain_filters_in_configured_order() -> None:
    filtered = Chain([AddOne(IdentityHParams()), Double(IdentityHParams())]).filter(update(9.0), CTX)
    assert filtered.tensors["w"].item() == (9.0 - 1) / 2


def test_a_payload_from_a_plugin_the_receiver_lacks_is_refused() -> None:
    encoded = Chain([AddOne(IdentityHParams()), Double(IdentityHParams())]).encode(update(), CTX)
    with pytest.raises(ValueError, match="^payload was encoded by plugin 'double', which this side's chain lacks$"):
        Chain([AddOne(IdentityHParams())]).decode(encoded, CTX)


def test_the_loop_rejects_such_an_update(caplog: pytest.LogCaptureFixture) -> None:
    from fedweave.federated.receive import accept_updates
    from fedweave.types import Message

    good = Chain([AddOne(IdentityHParams())]).encode(update(), CTX)
    foreign = replace(update(), applied=["secret_plugin"])
    chains = Chains(client_send=Chain([AddOne(IdentityHParams())]))
    failures: dict[int, str] = {}
    with caplog.at_level(logging.WARNING, logger="fedweave.federated.receive"):
        accepted = accept_updates(chains, [Message(1, 0, good), Message(1, 1, foreign)], failures, {"w": torch.zeros(1, dtype=torch.float64)})
    assert [u.tensors["w"].item() for u in accepted] == [3.0]
    assert failures == {1: "rejected: payload was encoded by plugin 'secret_plugin', which this side's chain lacks"}
    assert "update of client 1 rejected: payload was encoded by plugin 'secret_plugin'" in caplog.text


def test_chains_decode_then_filter_both_ways() -> None:
    chains = Chains(
        server_send=Chain([Identity(IdentityHParams())]),
        client_receive=Chain([Identity(IdentityHParams())]),
        client_send=Chain([AddOne(IdentityHParams())]),
        server_receive=Chain([Double(IdentityHParams())]),
    )
    instruction = Instruction(1, TaskKind.TRAIN, Work(0, 8), {"w": torch.ones(1)})
    sent = chains.server_send.encode(instruction, CTX)
    assert sent.applied == ["identity"] and sent is not instruction
    received = chains.to_client(sent, CTX)
    assert received.applied == [] and received.params is instruction.params
    back = chains.to_server(chains.client_send.encode(update(5.0), CTX), CTX)
    assert back.tensors["w"].item() == 5.0 / 2  # client_send undone, then the server_receive filter


def test_identity_returns_a_copy() -> None:
    original = update()
    plugin = Identity(IdentityHParams())
    assert plugin.encode(original, CTX) is not original
    assert plugin.decode(original, CTX) is not original
    assert plugin.encode(original, CTX) == original


ALL_POINTS = (
    "plugins={server_send: [identity], client_receive: [identity], client_send: [identity], "
    "server_receive: [identity]}"
)


def test_identity_at_all_four_points_changes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: Counter[tuple[str, str, str]] = Counter()

    def counting(method: str) -> Callable[[Identity, Payload, PluginContext], Payload]:
        def call(self: Identity, payload: Payload, ctx: PluginContext) -> Payload:
            calls[(method, type(payload).__name__, ctx.side)] += 1
            return replace(payload)

        return call

    plain, plain_records = run_to_end(tmp_path / "plain")
    monkeypatch.setattr(Identity, "encode", counting("encode"))
    monkeypatch.setattr(Identity, "decode", counting("decode"))
    chained, chained_records = run_to_end(tmp_path / "chained", ALL_POINTS)
    assert_same_params(plain, chained)
    assert comparable(plain_records) == comparable(chained_records)
    sends = 3 * 4  # 3 rounds × 4 clients
    assert calls == {
        ("encode", "Instruction", "server"): sends,  # server_send
        ("decode", "Instruction", "client"): 2 * sends,  # server_send undone, then the client_receive filter
        ("encode", "Update", "client"): sends,  # client_send
        ("decode", "Update", "server"): 2 * sends,  # client_send undone, then the server_receive filter
    }


# --------------------------------------------------------------------------- composition


@dataclass
class SummingHParams:
    """No settings."""


class Summing(Identity):
    """A plugin the server must combine while encoded (as secure aggregation is)."""

    name = "summing"
    HParams = SummingHParams
    combines_encoded = True

    def combine(self, updates: list[Update], ctx: PluginContext) -> Update:
        total = sum(u.num_examples for u in updates)
        tensors = {k: sum(u.tensors[k] * u.num_examples for u in updates) / total for k in updates[0].tensors}
        return Update(UpdateKind.DELTA, tensors, total, applied=list(updates[0].applied))


class MedianLike(FedAvg):
    """A strategy whose server step is not a weighted sum (as a median is not)."""

    weighted_sum = False


SUMMING = f"{__name__}:Summing"


def test_a_combining_plugin_needs_a_weighted_sum_strategy() -> None:
    with pytest.raises(ConfigError) as info:
        small_config(f"strategy={__name__}:MedianLike", f"plugins.client_send=['{SUMMING}']")
    message = str(info.value)
    assert "\n" not in message
    assert message == (
        f"config key 'plugins.client_send[0]': plugin '{SUMMING}' makes the server combine updates while "
        f"encoded, which needs a weighted-sum server step; strategy '{__name__}:MedianLike' does not "
        "aggregate by a weighted sum"
    )


@pytest.mark.parametrize("point", ["server_send", "client_receive", "server_receive"])
def test_a_combining_plugin_only_fits_client_send(point: str) -> None:
    with pytest.raises(ConfigError, match=rf"^config key 'plugins\.{point}\[0\]': plugin '{SUMMING}' combines"):
        small_config(f"plugins.{point}=['{SUMMING}']")


def test_a_combining_plugin_with_fedavg_is_accepted_and_averages_the_same(tmp_path: Path) -> None:
    plain, _ = run_to_end(tmp_path / "plain")
    combined, records = run_to_end(tmp_path / "combined", f"plugins.client_send=['{SUMMING}']")
    assert all(r["clients_completed"] == 4 and not r["skipped"] for r in records)
    assert_same_params(plain, combined, atol=1e-6)


def test_a_metric_two_plugins_report_is_named_by_each_plugin() -> None:
    @dataclass
    class Reporting:
        name: str
        values: dict[str, float]

        def metrics(self) -> dict[str, float]:
            return self.values

    chains = Chains(
        client_receive=Chain([Reporting("dpsgd", {"epsilon": 2.0})]),  # type: ignore[list-item]
        client_send=Chain([Reporting("dp_central", {"epsilon": 5.0, "clip_norm": 0.5})]),  # type: ignore[list-item]
    )
    assert chains.metrics() == {"dpsgd.epsilon": 2.0, "dp_central.epsilon": 5.0, "clip_norm": 0.5}
    assert Chains(client_send=chains.client_send).metrics() == {"epsilon": 5.0, "clip_norm": 0.5}


@pytest.mark.parametrize("applied", [["secagg"], ["secagg", "randk"], ["randk", "secagg", "randk"], []])
def test_an_update_that_names_another_chain_than_the_run_s_is_refused_alone_on_receipt(applied: list[str]) -> None:
    """The round's sum is decoded as its first update says it was encoded: one client claiming
    only secagg left the sum encoded and skipped the round. Now that update is refused on receipt."""
    chains = Chains(client_send=Chain([make("randk", ratio=0.25, shared_indices=True), make("secagg", clients=3)]))
    forged = replace(plugin_update({"w": torch.zeros(40)}, client_id=1), applied=applied)
    with pytest.raises(ValueError, match=r"not by this run's client_send chain \['randk', 'secagg'\]"):
        chains.to_server(forged, PluginContext(1, 1, "server"))
