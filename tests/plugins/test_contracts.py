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
    Answers,
    Binds,
    Combines,
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
    stage = "compress"
    points = ("client_send",)


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
    ],
)
def test_a_broken_contract_is_one_line_at_load(point: str, cls: type, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        small_config(f"plugins.{point}=[{{name: '{path(cls)}'}}]")
    assert f"config key 'plugins.{point}[0]'" in str(err.value)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


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
