"""Every composition rule, each broken by one config, and a grid of combinations that load and build."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest

from fedweave import rules, runner
from fedweave.errors import ConfigError
from fedweave.types import UpdateKind
from conftest import small_config

HERE = __name__


class GradientOnly:
    """A plugin that accepts gradient updates only."""

    name: ClassVar[str] = "gradient_only"
    accepts: ClassVar[frozenset[UpdateKind]] = frozenset({UpdateKind.GRADIENT})
    combines_encoded: ClassVar[bool] = False

    @dataclass
    class HParams:
        pass

    def __init__(self, params: Any) -> None:
        pass

    def encode(self, payload: Any, ctx: Any) -> Any:
        return payload

    def decode(self, payload: Any, ctx: Any) -> Any:
        return payload


BROKEN: dict[str, tuple[list[str], str]] = {
    "launcher_transport": (["launcher=process"], "config key 'launcher': 'process' runs every node"),
    "ray_launcher": (["launcher=ray", "transport=grpc"], "config key 'launcher': 'ray' carries the clients' work"),
    "ring_transport": (["topology=ring", "transport=grpc"], "config key 'topology.kind': ring gossip runs in simulation"),
    "hierarchy_transport": (
        ["topology={kind: hierarchical, sites: 2}", "topology.outer=grpc"],
        "config key 'topology.outer': 'grpc' is the server's link",
    ),
    "own_data_topology": (
        ["task.dataset=files", "task.dataset_options={path: 'site_{client}.csv', label: y}", "transport=grpc",
         "topology={kind: hierarchical, sites: 2, inner: torchdist}"],
        "config key 'topology.kind': sites that read their own data",
    ),
    "emulation_topology": (
        ["heterogeneity.speeds=[1, 2, 3, 4]", "topology=ring"],
        "config key 'heterogeneity': emulated client speeds need the in-process simulation",
    ),
    "plugin_contracts": (
        ["plugins.client_send=[clip, clip]"],
        "config key 'plugins.client_send[1]': plugin name 'clip' is already plugins.client_send[0]",
    ),
    "strategy_settings": (["strategy=fednova", "local.optimizer=adam"], "config key 'local.optimizer': FedNova"),
    "krum_cohort": (["aggregation=krum"], "config key 'aggregation.byzantine': krum with f=1 needs more than"),
    "ring_strategy": (
        ["topology=ring", "strategy=scaffold"],
        "config key 'topology.kind': ring gossip needs a plain weighted-mean server",
    ),
    "combining_plugins": (
        ["plugins.client_send=[secagg]", "aggregation=median"],
        "config key 'plugins.client_send[0]': plugin 'secagg' makes the server combine updates while encoded",
    ),
    "sealed_model": (
        ["plugins.client_send=[he]", "eval.every=0", "strategy=fedavgm"],
        "config key 'strategy.name': plugin 'he' keeps the global model encrypted",
    ),
    "update_kinds": (
        [f"plugins.client_send=[{{name: '{HERE}:GradientOnly'}}]"],
        f"config key 'plugins.client_send[0]': plugin '{HERE}:GradientOnly' accepts gradient updates",
    ),
    "plugin_order": (
        ["plugins.client_send=[topk, clip]"],
        "config key 'plugins.client_send[1]': plugin 'clip' (clip) comes after 'topk'",
    ),
    "asynchronous_aggregation": (
        ["asynchronous.enabled=true", "heterogeneity.clock=virtual", "plugins.client_send=[secagg]"],
        "config key 'plugins.client_send[0]': plugin 'secagg' works per synchronous round",
    ),
    "asynchronous_deployment": (
        ["asynchronous.enabled=true", "transport=grpc", "eval.federated_every=1"],
        "config key 'eval.federated_every': deployed asynchronous clients are always training",
    ),
    "attack_labels": (
        ["task.kind=regression", "task.partition=iid", "attacks.kind=label_flip", "attacks.clients=[0]"],
        "config key 'attacks.kind': label_flip flips class ids, a regression task has none",
    ),
    "per_client_evaluation": (
        ["eval.federated_every=1", "eval.per_client=true", "plugins.client_send=[{name: dp_local, noise_multiplier: 1.0}]"],
        "config key 'eval.per_client': each client's own metrics are not released under differential privacy",
    ),
    "adapter_strategies": (
        ["task.kind=language_model", "task.model=hf:base", "task.model_options={}", "task.peft=lora", "task.partition=iid",
         "strategy=moon"],
        "config key 'strategy.name': moon contrasts the model's representation layer, but task.peft trains",
    ),
}


def test_every_rule_has_a_config_that_breaks_it() -> None:
    assert set(BROKEN) == {rule.__name__ for rule in rules.RULES}


@pytest.mark.parametrize("rule", sorted(BROKEN))
def test_a_broken_rule_is_one_line_at_load(rule: str) -> None:
    overrides, start = BROKEN[rule]
    with pytest.raises(ConfigError) as err:
        small_config(*overrides)
    assert str(err.value).startswith(start), str(err.value)
    assert "\n" not in str(err.value)


def test_ring_with_scaffold_fails_at_load_not_at_build() -> None:
    with pytest.raises(ConfigError, match="ring gossip needs a plain weighted-mean server"):
        small_config("topology=ring", "strategy=scaffold")


GRID = {
    "strategy": ["fedavg", "scaffold"],
    "aggregation": ["mean", "median"],
    "topology": ["star", "ring", "{kind: hierarchical, sites: 2}"],
    "plugins.client_send": ["[]", "[secagg]", "[topk]"],
}


def test_every_loadable_combination_of_the_grid_builds(tmp_path: Path) -> None:
    loaded = refused = 0
    for i, values in enumerate(itertools.product(*GRID.values())):
        overrides = [f"{key}={value}" for key, value in zip(GRID, values)]
        try:
            config = small_config(*overrides, "rounds=1", output=tmp_path)
        except ConfigError as exc:
            assert "\n" not in str(exc)
            refused += 1
            continue
        loaded += 1
        r = runner.prepare(config, tmp_path / f"run{i}")
        r.parts.topology.close()
    assert loaded and refused  # the grid holds both kinds


@pytest.mark.parametrize("compressor", ["{name: randk, shared_indices: true}", "{name: quantize, dtype: bfloat16}", "topk"])
def test_he_after_a_compressor_is_refused_at_load(compressor: str) -> None:
    """HE adds each encrypted update into the encrypted model: a compressed layout cannot be added."""
    with pytest.raises(ConfigError, match=r"^config key 'plugins.client_send\[0\]': plugin 'he' adds every value"):
        small_config(f"plugins.client_send=[{compressor}, he]", "eval.every=0")


def test_he_after_clipping_and_noise_loads() -> None:
    assert small_config("plugins.client_send=[clip, dp_local, he]", "eval.every=0").plugins.client_send[2].name == "he"
