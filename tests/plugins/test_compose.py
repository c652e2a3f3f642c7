"""Composition rules: every refusal names the key and says why; the allowed chains load."""

from __future__ import annotations

import logging

import pytest

from conftest import small_config
from fedweave.errors import ConfigError
from fedweave.plugins.contracts import PluginContext
from fedweave.plugins.identity import Identity
from fedweave.training import SGD_LOOP, LocalTraining


def chain(point: str, *items: str) -> str:
    return f"plugins.{point}=[{', '.join(items)}]"


REFUSED = [
    (chain("server_send", "{name: clip}"), r"'plugins.server_send\[0\]': plugin 'clip' belongs in plugins.client_send: it bounds client updates"),
    (chain("client_send", "{name: dpsgd}"), r"'plugins.client_send\[0\]': plugin 'dpsgd' belongs in plugins.client_receive: it sets up each client's private local training"),
    (chain("server_receive", "{name: topk}"), r"'plugins.server_receive\[0\]': plugin 'topk' belongs in plugins.server_send or plugins.client_send: it encodes at one end and decodes at the other"),
    (chain("client_receive", "{name: dp_local}"), r"'plugins.client_receive\[0\]': plugin 'dp_local' belongs in plugins.client_send: it adds privacy noise"),
    (chain("server_send", "{name: secagg}"), r"'plugins.server_send\[0\]': plugin 'secagg' combines client updates while encoded, so it belongs in plugins.client_send"),
    (chain("client_send", "{name: dp_local}", "{name: clip}"), r"'plugins.client_send\[1\]': plugin 'clip' \(clip\) comes after 'dp_local' \(noise, plugins.client_send\[0\]\); the order is clip, noise, compress, secure: the noise is calibrated to the clip norm"),
    (chain("client_send", "{name: topk}", "{name: clip}"), r"'plugins.client_send\[1\]': plugin 'clip' \(clip\) comes after 'topk' \(compress.*clipping bounds the update actually sent only when it comes before compression"),
    (chain("client_send", "{name: qsgd}", "{name: dp_local}"), r"'plugins.client_send\[1\]': plugin 'dp_local' \(noise\) comes after 'qsgd' \(compress.*compressing a noised update is post-processing"),
    (chain("client_send", "{name: secagg}", "{name: topk}"), r"'plugins.client_send\[1\]': plugin 'topk' comes after 'secagg' \(plugins.client_send\[0\]\), which masks or encrypts the update: nothing may follow it"),
    (chain("client_send", "{name: he}", "{name: identity}") + " && eval.every=0", r"'plugins.client_send\[1\]': plugin 'identity' comes after 'he'.*nothing may follow it"),
    (chain("client_send", "{name: dp_central}", "{name: secagg}"), r"'plugins.client_send\[1\]': plugins 'dp_central' \(plugins.client_send\[0\]\) and 'secagg' both make the server combine.*put dp_local before secagg"),
    (chain("client_send", "{name: topk}", "{name: secagg}"), r"'plugins.client_send\[0\]': plugin 'topk' comes before 'secagg', which sums the encoded updates, but payloads 'topk' encoded for different clients cannot be summed.*randk with shared_indices: true"),
    (chain("client_send", "{name: quantize, dtype: int8}", "{name: secagg}"), r"'plugins.client_send\[0\]': plugin 'quantize' comes before 'secagg'.*cannot be summed"),
    (chain("client_send", "{name: randk}", "{name: secagg}"), r"'plugins.client_send\[0\]': plugin 'randk' comes before 'secagg'.*cannot be summed"),
    (chain("client_send", "{name: identity}", "{name: secagg}"), r"'plugins.client_send\[0\]': plugin 'identity' comes before 'secagg'.*can declare summable = True"),
    (chain("client_send", "{name: secagg}") + " && aggregation.rule=median", r"'plugins.client_send\[0\]': plugin 'secagg' makes the server combine updates while encoded, so it only sees their sum; aggregation.rule 'median'"),
    (chain("client_send", "{name: he}") + " && strategy=scaffold", r"'plugins.client_send\[0\]': plugin 'he' makes the server combine updates while encoded, which needs a weighted-sum server step; strategy 'scaffold'"),
    (chain("client_send", "{name: secagg, bits: 20, max_examples: 100000}"), r"'plugins.client_send\[0\].max_examples': 100000 leaves fewer than 8 bits of precision"),
    (chain("client_send", "{name: secagg, bits: 24, max_examples: 65537}"), r"'plugins.client_send\[0\].max_examples': 65537 leaves fewer than 8 bits of precision"),
    (chain("client_send", "{name: he}") + " && transport=grpc && eval.every=0", r"plugin 'he' needs the server and the clients in one process \(without keys each process would make its own CKKS context"),
    (chain("client_send", "{name: he}") + " && topology={kind: hierarchical, sites: 2, inner: torchdist} && eval.every=0", r"plugin 'he' needs the server and the clients in one process \(.*\); topology.inner 'torchdist' runs them apart"),
    (chain("client_send", "{name: topk, ratio: 0}"), r"'plugins.client_send\[0\].ratio': must be > 0"),
    (chain("client_send", "{name: topk}", "{name: quantize}"), r"^config key 'plugins.client_send\[1\]': plugin 'quantize' would compress what 'topk' already encoded"),
    (chain("server_send", "{name: randk}", "{name: qsgd}"), r"^config key 'plugins.server_send\[1\]': plugin 'qsgd' would compress what 'randk' already encoded"),
    (chain("client_send", "{name: he, poly_degree: 1000}"), r"'plugins.client_send\[0\].poly_degree': 1000 is not allowed"),
    (chain("client_send", "{name: dp_local}") + " && strategy=scaffold", r"^config key 'plugins.client_send\[0\]': plugin 'dp_local' cannot protect what strategy 'scaffold' sends in its extras: Δc_i = −c − Δy_i/\(K·η_l\).*\(strategy.option II\), computed before client_send"),
    (chain("client_send", "{name: clip}", "{name: dp_local}") + " && strategy={name: scaffold, option: I}", r"'plugins.client_send\[1\]': plugin 'dp_local' cannot protect .*the exact gradient of its whole training set \(strategy.option I\), computed from the raw data"),
    (chain("client_receive", "{name: dpsgd}") + " && strategy={name: scaffold, option: I}", r"'plugins.client_receive\[0\]': plugin 'dpsgd' cannot protect .*\(strategy.option I\), computed from the raw data, outside any private training"),
    (chain("client_send", "{name: dp_local, seeded_noise: true}") + " && transport=grpc", r"'plugins.client_send\[0\].seeded_noise': plugin 'dp_local' would draw its noise from the run seed.*transport 'grpc' runs the nodes apart"),
    (chain("client_send", "{name: dp_local}") + " && checkpoint.min_interval=5", r"^config key 'checkpoint.min_interval': 5 s lets a resumed run redo the rounds since its last checkpoint, and plugin 'dp_local' \(plugins.client_send\[0\]\) draws fresh privacy noise each round, so a round done again is a second privacy release"),
    (chain("client_send", "{name: clip}", "{name: dp_central}") + " && checkpoint.every=2", r"^config key 'checkpoint.every': 2 lets .* plugin 'dp_central' \(plugins.client_send\[1\]\) draws fresh privacy noise"),
    (chain("client_receive", "{name: dpsgd}") + " && checkpoint.min_interval=0.5 && transport=grpc", r"^config key 'checkpoint.min_interval': 0.5 s .* plugin 'dpsgd' \(plugins.client_receive\[0\]\) draws fresh privacy noise and batch sampling"),
]


@pytest.mark.parametrize("overrides,message", REFUSED, ids=[f"{i}" for i in range(len(REFUSED))])
def test_refused_chains_say_where_and_why(overrides: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as refused:
        small_config(*overrides.split(" && "))
    assert "\n" not in str(refused.value)


def test_a_timed_cadence_with_reproducible_or_harmless_draws_loads(caplog: pytest.LogCaptureFixture) -> None:
    """Seeded noise repeats when a round is redone; secagg's fresh rounding only moves the result a little (warned)."""
    with caplog.at_level(logging.WARNING, logger="fedweave.plugins.compose"):
        small_config(chain("client_send", "{name: dp_central, seeded_noise: true}"), "checkpoint.min_interval=5")
        small_config(chain("client_send", "{name: clip}", "{name: secagg, seeded_noise: true}"), "checkpoint.every=3")
        assert caplog.text == ""
        small_config(chain("client_send", "{name: clip}", "{name: secagg}"), "checkpoint.min_interval=5")
    assert "checkpoint.min_interval 5 s: plugin 'secagg' (plugins.client_send[1]) draws fresh stochastic rounding" in caplog.text
    assert "differ slightly from an uninterrupted run's" in caplog.text


ALLOWED = [
    chain("client_send", "{name: clip}", "{name: dp_local}", "{name: quantize, dtype: float16}", "{name: secagg}"),
    chain("client_send", "{name: clip}", "{name: randk, shared_indices: true}", "{name: secagg}"),
    chain("client_send", "{name: clip}", "{name: dp_local}", "{name: he}") + " && eval.every=0",
    chain("client_send", "{name: dp_central}", "{name: topk}"),
    chain("client_send", "{name: clip}", "{name: dp_central, adaptive: true, count_noise: 2.0}", "{name: powersgd}"),
    chain("server_send", "{name: topk, values: float16}"),
    chain("client_receive", "{name: dpsgd}"),
    chain("client_send", "{name: he, keys: keys}") + " && transport=grpc && eval.every=0",
    chain("client_send", "{name: dp_central}", "{name: topk}") + " && transport=grpc",
    chain("client_send", "{name: dp_central, adaptive: true, count_noise: 2.0}") + " && transport=grpc",
    chain("client_receive", "{name: dpsgd, target_epsilon: 5.0}") + " && transport=grpc",
    chain("client_send", "{name: clip}", "{name: secagg, neighbours: 4}") + " && transport=grpc",
    chain("client_send", "{name: secagg}") + " && topology={kind: hierarchical, sites: 2}",
    chain("client_send", "{name: secagg}") + " && topology={kind: hierarchical, sites: 2, inner: torchdist} && transport=grpc",
    chain("client_send", "{name: secagg}") + " && topology={kind: hierarchical, sites: 2, inner: torchdist}",
    chain("client_receive", "{name: dpsgd}") + " && strategy=scaffold",  # option II: Δc is post-processing of DP-SGD
    chain("client_send", "{name: clip}") + " && strategy={name: scaffold, option: I}",  # clip alone promises no privacy
    chain("client_send", "{name: dp_local}") + " && strategy=fednova",  # a_i restates the step count
    chain("client_send", "{name: dp_local, seeded_noise: true}", "{name: secagg}"),
    chain("client_send", "{name: secagg, bits: 24, max_examples: 65536}"),  # exactly 8 bits of precision left
]


@pytest.mark.parametrize("overrides", ALLOWED)
def test_allowed_chains_load(overrides: str) -> None:
    small_config(*overrides.split(" && "))


class OwnLoop(Identity):
    """A user plugin that takes over local training with the plain loop (a stand-in for LoRA's wrapper)."""

    name = "own_loop"

    def training(self, ctx: PluginContext) -> LocalTraining:
        return SGD_LOOP


def test_one_plugin_of_a_run_may_take_over_local_training() -> None:
    own = f"{{name: '{__name__}:OwnLoop'}}"
    assert small_config(f"plugins.client_receive=[{own}]").plugins.client_receive[0].name.endswith(":OwnLoop")
    with pytest.raises(ConfigError, match=r"^config key 'plugins.client_receive\[1\]': plugin '.*:OwnLoop' would take over "
                                          r"local training, which 'dpsgd' already does; one plugin of a run may$"):
        small_config(f"plugins.client_receive=[dpsgd, {own}]")
