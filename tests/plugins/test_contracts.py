"""Plugin capabilities as typed protocols: each violation is one line at load; a strategy's metrics() is recorded."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from conftest import small_config
from fedweave import runner
from fedweave.errors import ConfigError
from fedweave.plugins.chain import Chain, Chains
from fedweave.plugins.contracts import (
    NOTHING,
    Answers,
    Binds,
    Combines,
    Declaration,
    Plugin,
    ReportsMetrics,
    RunsProtocol,
    SealsModel,
    Stateful,
)
from fedweave.strategies.fedavg import FedAvg
from fedweave.types import Update, UpdateKind


class Base:
    name = "base"
    accepts = frozenset(UpdateKind)
    combines_encoded = False

    @dataclass
    class HParams:
        pass

    def __init__(self, hp: Any) -> None:
        self.hp = hp

    def encode(self, payload: Any, ctx: Any) -> Any:
        return payload

    def decode(self, payload: Any, ctx: Any) -> Any:
        return payload


class NoDecode:
    name = "no_decode"
    accepts = frozenset(UpdateKind)
    combines_encoded = False
    HParams = Base.HParams

    def encode(self, payload: Any, ctx: Any) -> Any:
        return payload


class CombinesWithoutCombine(Base):
    name = "combines_without_combine"
    combines_encoded = True


class HalfProtocol(Base):
    name = "half_protocol"
    combines_encoded = True

    def setup(self, rnd: int, cohort: list[int], exchange: Any) -> list[int]:
        return cohort

    def combine(self, updates: list[Update], ctx: Any, exchange: Any) -> Update:
        return updates[0]


class SaveOnly(Base):
    name = "save_only"

    def state_dict(self) -> dict[str, Any]:
        return {}


class SetupNotCombining(Base):
    name = "setup_not_combining"

    def setup(self, rnd: int, cohort: list[int], exchange: Any) -> list[int]:
        return cohort

    def combine(self, updates: list[Update], ctx: Any, exchange: Any) -> Update:
        return updates[0]

    def answer(self, control: Any, ctx: Any) -> Any:
        return control


class UplinkCompressor(Base):
    name = "uplink_compressor"
    declares = Declaration(stage="compress", points=("client_send",))


class DeclaresAString(Base):
    name = "declares_a_string"
    declares = "compress"


class UnknownStage(Base):
    name = "unknown_stage"
    declares = Declaration(stage="compression")


class PointsAsAString(Base):
    name = "points_as_a_string"
    declares = Declaration(points="client_send")


class SummableAsAString(Base):
    name = "summable_as_a_string"
    declares = Declaration(summable="yes")


class UnknownProtection(Base):
    name = "unknown_protection"
    declares = Declaration(protects="everything")


class BareStage(Base):
    name = "bare_stage"
    stage = "clip"
    summable = True


def path(cls: type) -> str:
    return f"{__name__}:{cls.__name__}"


@pytest.mark.parametrize(
    ("point", "cls", "message"),
    [
        ("client_send", NoDecode, "lacks decode of the Plugin protocol"),
        ("client_send", CombinesWithoutCombine, "declares combines_encoded = True but lacks combine(updates, ctx)"),
        ("client_send", HalfProtocol, "has setup, combine but lacks answer of the RunsProtocol and Answers protocols"),
        ("client_send", SaveOnly, "has state_dict but lacks load_state_dict of the Stateful protocol"),
        ("client_send", SetupNotCombining, "has setup(), which runs only for a plugin that combines updates"),
        ("server_send", UplinkCompressor, "belongs in plugins.client_send: its class declares points = ('client_send',)"),
        ("client_send", DeclaresAString, "declares must be a fedweave.plugins.contracts.Declaration, got str"),
        ("client_send", UnknownStage, "its Declaration's stage must be one of clip, noise, compress, secure, train"),
        ("client_send", PointsAsAString, "its Declaration's points must be a non-empty tuple of server_send,"),
        ("client_send", SummableAsAString, "its Declaration's summable must be a bool or a function"),
        ("client_send", UnknownProtection, "its Declaration's protects must be one of update, training or None"),
        ("client_send", BareStage, "declares stage, summable as class attributes, which the rules do not read; "
         "declare them as declares = Declaration(stage=..., summable=...)"),
    ],
)
def test_a_broken_contract_is_one_line_at_load(point: str, cls: type, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        small_config(f"plugins.{point}=[{{name: '{path(cls)}'}}]")
    assert f"config key 'plugins.{point}[0]'" in str(err.value)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_every_built_in_plugin_declares_through_one_declaration() -> None:
    from fedweave.plugins import PLUGINS
    from fedweave.plugins.compression.quantize import QuantizeHParams
    from fedweave.plugins.compression.randk import RandKHParams
    from fedweave.plugins.contracts import check_plugin_class

    for name in PLUGINS.names():
        cls = PLUGINS.get(name, "plugins.client_send[0].name")
        check_plugin_class(cls, "plugins.client_send[0]")  # no bare stage, points, summable, ... beside it
        assert isinstance(getattr(cls, "declares", NOTHING), Declaration), name
    declared = {name: getattr(PLUGINS.get(name, "k"), "declares", NOTHING) for name in PLUGINS.names()}
    assert declared["clip"] == Declaration(stage="clip", points=("client_send",), summable=True)
    assert declared["dp_local"].protects == "update" and declared["dpsgd"].protects == "training"
    assert declared["he"].needs_one_process(PLUGINS.get("he", "k").HParams()) is not None
    assert declared["quantize"].is_summable(QuantizeHParams(dtype="float16"))
    assert not declared["quantize"].is_summable(QuantizeHParams(dtype="int8"))
    assert declared["randk"].is_summable(RandKHParams(shared_indices=True)) and not declared["topk"].is_summable(None)


def test_a_compressor_outside_the_send_chains_is_told_why() -> None:
    with pytest.raises(ConfigError, match="which only the send chains do"):
        small_config("plugins.client_receive=[topk]")


def test_the_protocols_recognise_the_built_in_plugins() -> None:
    from fedweave.plugins.compression.topk import TopK
    from fedweave.plugins.privacy.dp import DPCentral
    from fedweave.plugins.secure.he import HE
    from fedweave.plugins.secure.secagg import SecAgg

    assert isinstance(TopK, Plugin) and isinstance(TopK, Stateful) and isinstance(TopK, Binds)
    assert isinstance(SecAgg, RunsProtocol) and isinstance(SecAgg, Answers)
    # HE combines while encoded into a global model it keeps encrypted, which clients decrypt and check (its step)
    assert isinstance(HE, SealsModel) and isinstance(HE, Stateful) and isinstance(HE, ReportsMetrics)
    assert isinstance(HE, RunsProtocol) and isinstance(HE, Answers) and not isinstance(SecAgg, SealsModel)
    assert not isinstance(TopK, Combines) and not isinstance(TopK, RunsProtocol)
    assert isinstance(DPCentral, ReportsMetrics) and not isinstance(TopK, ReportsMetrics)


class Counted(Base):
    name = "counted"

    def __init__(self, hp: Any) -> None:
        super().__init__(hp)
        self.seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = state["seen"]


def test_a_chain_keeps_the_state_of_stateful_plugins_only() -> None:
    counted = Counted(None)
    counted.seen = 3
    chains = Chains(client_send=Chain([Base(None), counted]))
    assert chains.state_dict() == {"client_send[1]": {"seen": 3}}
    fresh = Counted(None)
    Chains(client_send=Chain([Base(None), fresh])).load_state_dict({"client_send[1]": {"seen": 5}})
    assert fresh.seen == 5


class CountingFedAvg(FedAvg):
    """FedAvg that reports how many updates each server step took and the round it was."""

    def aggregate(self, rnd: int, params: Any, updates: list[Update]) -> Any:
        self.last = {"updates": len(updates), "round": rnd}
        return super().aggregate(rnd, params, updates)

    def metrics(self) -> dict[str, float]:
        return self.last


def test_a_strategy_metrics_land_in_metrics_jsonl(tmp_path: Path) -> None:
    config = small_config(f"strategy={path(CountingFedAvg)}", "rounds=2", "clients=3")
    r = runner.prepare(config, tmp_path / "run")
    runner.execute(r)
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rounds = [line for line in lines if "round" in line and "strategy_updates" in line]
    assert [(x["round"], x["strategy_round"], x["strategy_updates"]) for x in rounds] == [(1, 1.0, 3.0), (2, 2.0, 3.0)]


def test_building_the_chains_checks_each_plugin_too() -> None:
    """A config assembled without loading (no rules run) still meets the contracts at build."""
    from fedweave.build import build_chains
    from fedweave.config import PluginSpec

    config = small_config()
    config.plugins.client_send = [PluginSpec(name=path(SaveOnly), params=Base.HParams())]
    with pytest.raises(ConfigError, match="has state_dict but lacks load_state_dict"):
        build_chains(config)
