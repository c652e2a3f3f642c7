"""Tests of fedweave.config: loading, overrides, every class of config error, the YAML round trip."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedweave import config as config_mod
from fedweave.config import Config, ConfigError
from fedweave.plugins.identity import Identity
from fedweave.registry import import_object
from fedweave.schema import describe_fields, opt
from fedweave.strategies.fedavg import FedAvg, FedAvgHParams
from fedweave.types import UpdateKind


@dataclass
class ProximalHParams:
    mu: float = opt(0.01, ge=0, help="proximal weight")


class Proximal(FedAvg):
    """FedAvg with one declared hyper-parameter, to test strategy settings."""

    HParams = ProximalHParams


@dataclass
class ScaleHParams:
    factor: float = opt(1.0, gt=0)


class Scale(Identity):
    """An identity plugin with one declared setting."""

    name = "scale"
    HParams = ScaleHParams


class WeightsOnly(Identity):
    """A plugin that only accepts full weights, not deltas."""

    name = "weights_only"
    accepts = frozenset({UpdateKind.WEIGHTS})


PROXIMAL = f"{__name__}:Proximal"
SCALE = f"{__name__}:Scale"


def error_of(*overrides: str) -> str:
    """The one-line message of the ConfigError that loading the quickstart with ``overrides`` raises."""
    with pytest.raises(ConfigError) as info:
        config_mod.load(None, list(overrides))
    message = str(info.value)
    assert "\n" not in message
    return message


def test_the_quickstart_is_the_default() -> None:
    config = config_mod.load()
    assert (config.name, config.rounds, config.clients, config.sample_fraction) == ("quickstart", 10, 10, 1.0)
    assert (config.task.dataset, config.task.model) == ("digits", "mlp")
    assert (config.task.partition.scheme, config.task.partition.alpha) == ("dirichlet", 1.0)
    assert (config.local.epochs, config.local.batch_size, config.local.lr, config.local.momentum) == (3, 16, 0.1, 0.9)
    assert config.strategy.name == "fedavg" and config.strategy.params == FedAvgHParams()
    assert (config.eval.every, config.eval.federated_every) == (1, 5)


# --------------------------------------------------------------------------- unknown keys


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("roudns=3", "unknown config key 'roudns' (did you mean 'rounds'?); valid keys here: aggregation, "),
        ("local.lrr=0.1", "unknown config key 'local.lrr' (did you mean 'local.lr'?); valid keys here: batch_size, "),
        (
            "task.partition.alpah=0.1",
            "unknown config key 'task.partition.alpah' (did you mean 'task.partition.alpha'?)",
        ),
        ("eval.evry=2", "unknown config key 'eval.evry' (did you mean 'eval.every'?)"),
        (
            "strategy.nmae=fedavg",
            "unknown config key 'strategy.nmae' (did you mean 'strategy.name'?); valid keys here: name",
        ),
        (
            "plugins.client_sned=[identity]",
            "unknown config key 'plugins.client_sned' (did you mean 'plugins.client_send'?)",
        ),
        (
            "plugins.client_send=[{nmae: identity}]",
            "unknown config key 'plugins.client_send[0].nmae' (did you mean 'plugins.client_send[0].name'?)",
        ),
    ],
)
def test_unknown_key_suggests_the_closest(override: str, message: str) -> None:
    assert error_of(override).startswith(message)


def test_unknown_strategy_setting_suggests_the_declared_one() -> None:
    assert error_of(f"strategy={{name: '{PROXIMAL}', muu: 0.1}}") == (
        "unknown config key 'strategy.muu' (did you mean 'strategy.mu'?); valid keys here: mu, name"
    )
    assert error_of("strategy.lr=0.1") == "unknown config key 'strategy.lr'; valid keys here: name"


def test_unknown_plugin_setting_suggests_the_declared_one() -> None:
    assert error_of(f"plugins.client_send=[{{name: '{SCALE}', factr: 2}}]") == (
        "unknown config key 'plugins.client_send[0].factr' (did you mean 'plugins.client_send[0].factor'?); "
        "valid keys here: factor, name"
    )


def test_strategy_and_plugin_settings_are_parsed_and_checked() -> None:
    config = config_mod.load(None, [f"strategy={{name: '{PROXIMAL}', mu: 0.5}}", f"plugins.server_send=['{SCALE}']"])
    assert config.strategy.params == ProximalHParams(mu=0.5)
    assert [(s.name, s.params) for s in config.plugins.server_send] == [(SCALE, ScaleHParams())]
    assert error_of(f"strategy={{name: '{PROXIMAL}', mu: -1}}") == "config key 'strategy.mu': must be >= 0, got -1.0"
    assert error_of(f"plugins.client_send=[{{name: '{SCALE}', factor: none}}]") == (
        "config key 'plugins.client_send[0].factor': expected a number, got 'none'"
    )


# --------------------------------------------------------------------------- types, ranges, combinations


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rounds=ten"], "config key 'rounds': expected an integer, got 'ten'"),
        (["rounds=2.5"], "config key 'rounds': expected an integer, got 2.5"),
        (["local.lr=fast"], "config key 'local.lr': expected a number, got 'fast'"),
        (["sample_fraction=[1]"], "config key 'sample_fraction': expected a number, got [1]"),
        (["round_timeout=soon"], "config key 'round_timeout': expected a number or null, got 'soon'"),
        (["name=[a]"], "config key 'name': expected a string, got ['a']"),
        (["task=digits"], "config key 'task': expected a mapping, got 'digits'"),
        (
            ["task.partition.scheme=dirichlett"],
            "config key 'task.partition.scheme': 'dirichlett' is not allowed; expected one of "
            "'iid', 'dirichlet', 'shards', 'quantity', 'inner_dirichlet', 'pathological', 'linear', 'square', "
            "'exponential', 'natural', 'from_file' (did you mean 'dirichlet'?)",
        ),
        (["task.loss=mse"], "config key 'task.loss': 'mse' is not a loss of kind classification; valid: cross_entropy, nll, bce or package.module:function"),
        (["strategy=[fedavg]"], "config key 'strategy': expected a name or a mapping, got ['fedavg']"),
        (["plugins=[identity]"], "config key 'plugins': expected a mapping of attachment points, got ['identity']"),
        (
            ["plugins.client_send=identity"],
            "config key 'plugins.client_send': expected a list of plugins, got 'identity'",
        ),
        (["plugins.client_send=[{}]"], "config key 'plugins.client_send[0].name' is required (a plugin name)"),
    ],
)
def test_wrong_types(overrides: list[str], message: str) -> None:
    assert error_of(*overrides) == message


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rounds=0", "config key 'rounds': must be >= 1, got 0"),
        ("clients=0", "config key 'clients': must be >= 1, got 0"),
        ("sample_fraction=0", "config key 'sample_fraction': must be > 0, got 0.0"),
        ("sample_fraction=1.5", "config key 'sample_fraction': must be <= 1, got 1.5"),
        ("seed=-1", "config key 'seed': must be >= 0, got -1"),
        ("local.momentum=1", "config key 'local.momentum': must be < 1, got 1.0"),
        ("local.lr=0", "config key 'local.lr': must be > 0, got 0.0"),
        ("local.steps=0", "config key 'local.steps': must be >= 1, got 0"),
        ("task.partition.alpha=0", "config key 'task.partition.alpha': must be > 0, got 0.0"),
        ("task.test_fraction=1", "config key 'task.test_fraction': must be < 1, got 1.0"),
        ("checkpoint.min_interval=-1", "config key 'checkpoint.min_interval': must be >= 0, got -1.0"),
    ],
)
def test_values_out_of_range(override: str, message: str) -> None:
    assert error_of(override) == message


def test_impossible_combinations() -> None:
    assert error_of("clients=4", "min_clients=5") == (
        "config key 'min_clients': 5 is more than clients=4; a round cannot sample more clients than exist"
    )
    assert error_of("task.local_test_fraction=0", "eval.federated_every=2").startswith(
        "config key 'eval.federated_every': federated evaluation needs clients' local test splits, "
        "but task.local_test_fraction is 0"
    )
    assert config_mod.load(None, ["task.local_test_fraction=0", "eval.federated_every=0"]).eval.federated_every == 0


def test_plugin_that_cannot_take_the_strategys_updates() -> None:
    assert error_of(f"plugins.client_send=['{__name__}:WeightsOnly']") == (
        f"config key 'plugins.client_send[0]': plugin '{__name__}:WeightsOnly' accepts weights updates, "
        "but strategy 'fedavg' sends delta"
    )


# --------------------------------------------------------------------------- unknown names


def test_unknown_strategy_and_plugin_names_suggest_the_closest() -> None:
    strategy = error_of("strategy=fedavgg")
    assert strategy.startswith(
        "config key 'strategy.name': unknown strategy 'fedavgg' (did you mean 'fedavg'?); built-in: "
    )
    assert strategy.endswith(", or give 'package.module:Class'")
    plugin = error_of("plugins.client_send=[identiy]")
    assert plugin.startswith(
        "config key 'plugins.client_send[0].name': unknown plugin 'identiy' (did you mean 'identity'?); built-in: "
    )
    assert "identity" in plugin.partition("built-in: ")[2].split(", ")
    assert "did you mean" not in error_of("strategy=zzzzzz")


def test_import_paths_that_do_not_resolve() -> None:
    assert error_of("strategy=no_such_module_xyz:Thing").startswith(
        "config key 'strategy.name': cannot import module 'no_such_module_xyz'"
    )
    assert error_of("strategy=fedweave.strategies.fedavg:Nope") == (
        "config key 'strategy.name': module 'fedweave.strategies.fedavg' has no 'Nope'"
    )
    with pytest.raises(ConfigError, match="^config key 'x': 'fedavg:' is not of the form 'package.module:name'$"):
        import_object("fedavg:", "x")
    assert error_of("strategy=fedweave.strategies.fedavg:FedAvgClient") == (
        "config key 'strategy.name': 'fedweave.strategies.fedavg:FedAvgClient' declares no HParams dataclass "
        "of its settings"
    )


# --------------------------------------------------------------------------- overrides


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rounds", "override 'rounds' is not of the form key=value (e.g. rounds=20)"),
        ("=3", "override '=3' is not of the form key=value (e.g. rounds=20)"),
        ("rounds.max=3", "override 'rounds.max=3': 'rounds' is not a section"),
        ("local.lr.value=3", "override 'local.lr.value=3': 'local.lr' is not a section"),
    ],
)
def test_bad_override_syntax(override: str, message: str) -> None:
    assert error_of(override) == message


def test_override_into_a_list_checks_the_index() -> None:
    assert error_of("plugins.client_send=[identity]", "plugins.client_send.3.name=identity") == (
        "override 'plugins.client_send.3.name=identity': 'plugins.client_send.3' is not an item "
        "of a list of 1 (indices 0..0)"
    )
    assert error_of("task.model_options={hidden: [8]}", "task.model_options.hidden.first=4") == (
        "override 'task.model_options.hidden.first=4': 'task.model_options.hidden.first' is not an item "
        "of a list of 1 (indices 0..0)"
    )
    config = config_mod.load(None, ["task.model_options={hidden: [8, 4]}", "task.model_options.hidden.1=2"])
    assert config.task.model_options == {"hidden": [8, 2]}


def test_dotted_overrides_reach_nested_keys() -> None:
    config = config_mod.load(None, ["task.partition.alpha=0.3", "local.batch_size=8", "eval.every=2"])
    assert (config.task.partition.alpha, config.local.batch_size, config.eval.every) == (0.3, 8, 2)


def test_override_values_are_parsed_as_yaml() -> None:
    config = config_mod.load(
        None,
        [
            "rounds=5",
            "local.lr=1e-3",
            "local.weight_decay=5.0e-4",
            "round_timeout=null",
            "name=my run",
            "task.model_options={hidden: [32, 16], dropout: 0.1}",
            "task.dataset_options={}",
        ],
    )
    assert config.rounds == 5 and type(config.rounds) is int
    assert config.local.lr == 0.001 and config.local.weight_decay == 0.0005
    assert config.round_timeout is None
    assert config.name == "my run"
    assert config.task.model_options == {"hidden": [32, 16], "dropout": 0.1}
    assert config.task.dataset_options == {}


def test_list_values() -> None:
    config = config_mod.load(None, ["plugins.client_send=[clip, {name: identity}]"])
    assert [s.name for s in config.plugins.client_send] == ["clip", "identity"]


def test_shorthand_overrides() -> None:
    config = config_mod.load(None, ["strategy=fedavg", "aggregation=mean", "topology=star", "transport=inmemory"])
    assert (config.strategy.name, config.aggregation.rule, config.topology.kind) == ("fedavg", "mean", "star")
    # a dotted key below a shorthand string turns it into its section
    proximal = config_mod.load(None, [f"strategy={PROXIMAL}", "strategy.mu=0.2"])
    assert (proximal.strategy.name, proximal.strategy.params) == (PROXIMAL, ProximalHParams(mu=0.2))
    partition = config_mod.load(None, ["task.partition=iid", "task.partition.min_samples=3"])
    assert (partition.task.partition.scheme, partition.task.partition.min_samples) == ("iid", 3)


def test_overrides_do_not_change_the_data_they_are_given() -> None:
    data = {"rounds": 3, "local": {"lr": 0.1}}
    assert config_mod.apply_overrides(data, ["rounds=4", "local.lr=0.5"]) == {"rounds": 4, "local": {"lr": 0.5}}
    assert data == {"rounds": 3, "local": {"lr": 0.1}}


# --------------------------------------------------------------------------- files


def test_load_a_file_with_overrides(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("name: filed\nrounds: 4\nlocal: {lr: 2e-2}\nstrategy: fedavg\n")
    config = config_mod.load(path, ["rounds=6"])
    assert (config.name, config.rounds, config.local.lr) == ("filed", 6, 0.02)
    assert config.clients == Config().clients  # keys not in the file take the schema defaults


def test_an_empty_file_is_all_defaults(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing here\n")
    assert config_mod.load(path) == Config(strategy=config_mod.StrategyConfig("fedavg", FedAvgHParams()))


def file_error(path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        config_mod.load(path)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_unreadable_and_invalid_files(tmp_path: Path) -> None:
    missing = tmp_path / "missing.yaml"
    assert file_error(missing) == f"cannot read config file '{missing}': No such file or directory"
    assert file_error(tmp_path) == f"cannot read config file '{tmp_path}': Is a directory"
    broken = tmp_path / "broken.yaml"
    broken.write_text("rounds: 3\nlocal: {lr: 0.1\n")
    assert file_error(broken) == f"config file '{broken}' line 3: not valid YAML"
    listed = tmp_path / "list.yaml"
    listed.write_text("- rounds: 3\n")
    assert file_error(listed) == f"config file '{listed}': expected a mapping of keys at the top level"
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00rounds")
    assert file_error(binary) == f"cannot read config file '{binary}': it is not UTF-8 text"


def test_errors_inside_a_file_name_the_key(tmp_path: Path) -> None:
    path = tmp_path / "typo.yaml"
    path.write_text("rounds: 3\nlocal:\n  lr: 0.1\n  epoch: 2\n")
    assert file_error(path).startswith("unknown config key 'local.epoch' (did you mean 'local.epochs'?)")


def test_from_dict_needs_a_mapping() -> None:
    with pytest.raises(ConfigError, match="^a config is a mapping of keys, got list$"):
        config_mod.from_dict([1, 2])  # type: ignore[arg-type]


# --------------------------------------------------------------------------- round trip


def test_to_yaml_then_load_gives_the_same_config(tmp_path: Path) -> None:
    config = config_mod.load(
        None,
        [
            "name=round-trip",
            "seed=7",
            "rounds=3",
            "sample_fraction=0.5",
            "min_clients=2",
            "round_timeout=30",
            "local.lr=1e-3",
            "local.steps=5",
            "task.model_options={hidden: [8]}",
            "task.partition={scheme: shards, shards_per_client: 3}",
            f"strategy={{name: '{PROXIMAL}', mu: 0.25}}",
            f"plugins.server_send=[{{name: '{SCALE}', factor: 2}}]",
            "plugins.client_send=[clip, identity]",
            "eval.federated_every=2",
        ],
    )
    path = tmp_path / "config.yaml"
    path.write_text(config_mod.to_yaml(config))
    assert config_mod.load(path) == config
    assert config_mod.load(path).strategy.params == ProximalHParams(mu=0.25)


def test_clients_per_round_honours_fraction_and_minimum() -> None:
    assert config_mod.load(None, ["clients=10", "sample_fraction=0.3"]).clients_per_round == 3
    assert config_mod.load(None, ["clients=10", "sample_fraction=0.1", "min_clients=4"]).clients_per_round == 4
    assert config_mod.load(None, ["clients=200", "sample_fraction=0.1"]).clients_per_round == 20
    assert config_mod.load(None, ["clients=3", "sample_fraction=0.01"]).clients_per_round == 1
    assert config_mod.load(None, ["clients=7"]).clients_per_round == 7


BILLION_LAUGHS = """\
a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]
b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]
f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]
g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]
h: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g]
i: &i [*h, *h, *h, *h, *h, *h, *h, *h, *h]
heterogeneity:
  speeds: *i
"""


def test_an_alias_bomb_is_refused_fast_before_it_expands(tmp_path: Path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(BILLION_LAUGHS)  # 9^9 values once expanded
    started = time.process_time()  # CPU time: what another process's load does not add to
    assert file_error(path) == (
        f"config file '{path}': refused, its aliases expand to more than "
        f"{config_mod.MAX_YAML_VALUES} values (an alias bomb?)"
    )
    assert time.process_time() - started < 10  # expanding 9^9 values would take minutes


def test_cycles_and_deep_nesting_are_refused(tmp_path: Path) -> None:
    cycle = tmp_path / "cycle.yaml"
    cycle.write_text("task:\n  dataset_options: &a {x: *a}\n")
    assert file_error(cycle) == (
        f"config file '{cycle}': refused, an alias refers to a collection that contains it (a cycle)"
    )
    deep = tmp_path / "deep.yaml"
    for levels in (config_mod.MAX_YAML_DEPTH + 1, 5000):  # past the limit, and past Python's recursion limit
        deep.write_text("speeds: " + "[" * levels + "]" * levels + "\n")
        assert file_error(deep) == f"config file '{deep}': refused, it nests deeper than {config_mod.MAX_YAML_DEPTH} levels"


def test_aliases_that_stay_small_are_still_yaml(tmp_path: Path) -> None:
    path = tmp_path / "anchors.yaml"
    path.write_text("x-local: &local {epochs: 2, batch_size: 8}\nlocal: *local\n")
    data = config_mod.read_yaml(path)
    assert data["local"] == {"epochs": 2, "batch_size": 8}
    assert config_mod.from_dict({"local": data["local"]}).local.batch_size == 8


@pytest.mark.parametrize(
    "name", ["../../x", "a/b", "..", ".hidden", "-rf", "tab\there", "new\nline", "bell\x07", "x" * 101, "end "]
)
def test_a_run_name_is_one_plain_folder_name(name: str) -> None:
    with pytest.raises(ConfigError, match=r"^config key 'name': .* is not a run name; it names the run's folder"):
        config_mod.from_dict({"name": name})


@pytest.mark.parametrize("name", ["digits-fedprox", "my run", "v1.2+fix", "実験_3", "x" * 100])
def test_plain_run_names_load(name: str) -> None:
    assert config_mod.from_dict({"name": name}).name == name


@pytest.mark.parametrize(
    ("override", "error"),
    [
        ("grpc.listen=127.0.0.1:99999", "config key 'grpc.listen': port 99999 is out of range 0..65535 (in '127.0.0.1:99999')"),
        ("grpc.address=host:65536", "config key 'grpc.address': port 65536 is out of range 0..65535 (in 'host:65536')"),
        ("grpc.address=host:²", "config key 'grpc.address': expected host:port, got 'host:²'"),
        ("grpc.address=host:٥", "config key 'grpc.address': expected host:port, got 'host:٥'"),
        ("grpc.address=:50051", "config key 'grpc.address': expected host:port, got ':50051'"),
        ("torchdist.port=70000", "config key 'torchdist.port': must be <= 65535, got 70000"),
    ],
)
def test_ports_out_of_range_are_refused_where_addresses_are_read(override: str, error: str) -> None:
    with pytest.raises(ConfigError) as refused:
        config_mod.load(None, [override])
    assert str(refused.value) == error


def test_addresses_parse_to_host_and_port() -> None:
    assert config_mod.parse_address("[::1]:50051", "x") == ("[::1]", 50051)
    assert config_mod.parse_address("0.0.0.0:0", "x") == ("0.0.0.0", 0)


# --------------------------------------------------------------------------- property-based

FUZZ = settings(
    max_examples=int(os.environ.get("FEDWEAVE_FUZZ_EXAMPLES", "40")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
"""Small in CI; ``FEDWEAVE_FUZZ_EXAMPLES=10000`` runs the full budget."""

KEYS = [row[0] for row in describe_fields(Config)] + [
    "strategy", "strategy.name", "strategy.mu", "plugins", "plugins.client_send", "plugins.server_receive",
    "task", "local", "grpc", "topology", "heterogeneity", "data_parallel",
]
"""Every dotted key of the schema, and the sections, so that generated configs reach deep checks."""

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.integers().map(lambda n: n * 10**400),  # beyond any float
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["fedavg", "fedprox", "clip", "topk", "dp_local", "mean", "median", "grpc", "star",
                     "hierarchical", "data_parallel", "asp", "mlp", "synthetic", "dirichlet", "0.0.0.0:1"]),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.sampled_from(["name", "kind", "every", "mu"]), st.text(max_size=6), st.integers()),
                        inner, max_size=4),
    ),
    max_leaves=12,
)


def _nest(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A config mapping from dotted keys (a later key may replace a section by a scalar)."""
    data: dict[str, Any] = {}
    for key, value in pairs:
        node = data
        *parents, last = key.split(".")
        for part in parents:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[last] = value
    return data


def loads_or_refuses(load: Callable[[], Config]) -> None:
    """The property: a Config, or the project's one-line ConfigError; never another exception."""
    try:
        config = load()
    except ConfigError as exc:
        assert "\n" not in str(exc)
        return
    assert isinstance(config, Config)
    assert config_mod.from_dict(config_mod.parse_yaml(config_mod.to_yaml(config))) == config


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(KEYS), VALUES), max_size=6))
def test_any_yaml_data_loads_or_is_one_config_error(pairs: list[tuple[str, Any]]) -> None:
    loads_or_refuses(lambda: config_mod.from_dict(_nest(pairs)))


@FUZZ
@given(st.lists(st.tuples(st.one_of(st.sampled_from(KEYS), st.text(max_size=10)), st.text(max_size=16)), max_size=4))
def test_any_dotted_overrides_load_or_are_one_config_error(items: list[tuple[str, str]]) -> None:
    loads_or_refuses(lambda: config_mod.load(None, [f"{key}={value}" for key, value in items]))


@FUZZ
@given(st.text(max_size=80))
def test_any_yaml_text_loads_or_is_one_config_error(yaml_dir: Path, text: str) -> None:
    path = yaml_dir / "fuzz.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    loads_or_refuses(lambda: config_mod.load(path))


@pytest.fixture(scope="module")
def yaml_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def test_values_python_cannot_hold_are_config_errors(tmp_path: Path) -> None:
    """Found by the property tests above: an integer beyond every float, one of 5000 digits, a bad date."""
    with pytest.raises(ConfigError, match=r"^config key 'heterogeneity.speed_range\[0\]': expected a finite number"):
        config_mod.from_dict({"heterogeneity": {"speed_range": [10**400, 10**401]}})
    path = tmp_path / "big.yaml"
    for text in ("rounds: " + "1" * 5000, "name: 2026-13-45"):
        path.write_text(text)
        assert file_error(path) == f"config file '{path}': not valid YAML"
    with pytest.raises(ConfigError, match=r"^unknown config key 'new\\nline'"):
        config_mod.load(None, ["new\nline=1"])
    with pytest.raises(ConfigError, match=r"^unknown config key 'plugins.0'"):
        config_mod.from_dict({"plugins": {0: None}})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["attacks=sign_flip"], "config key 'attacks.clients': an attack needs attacking clients"),
        (["attacks.clients=[1]"], "config key 'attacks.clients': an attack needs attacking clients"),
        (["attacks.kind=noise", "attacks.clients=[10]"], "config key 'attacks.clients': [10] are not client ids (0..9)"),
        (["attacks.kind=noise", "attacks.clients=[2, 2]"], "config key 'attacks.clients': [2, 2] names a client twice"),
        (["attacks.kind=scaling", "attacks.clients=[1]"], "config key 'attacks.scale': scaling by 1 changes nothing"),
        (["attacks.kind=[noise, noise]", "attacks.clients=[1]"], "config key 'attacks.kind': ['noise', 'noise'] names"),
        (["attacks.kind=flip", "attacks.clients=[1]"], "config key 'attacks.kind': expected one of 'none', 'sign_flip'"),
        (["attacks.std=0"], "config key 'attacks.std': must be > 0, got 0.0"),
        (["aggregation.max_examples=0"], "config key 'aggregation.max_examples': must be >= 1, got 0"),
        (["aggregation.max_weight_share=1.5"], "config key 'aggregation.max_weight_share': must be <= 1, got 1.5"),
        (["aggregation.weight_policy=capped"], "config key 'aggregation.weight_policy': 'capped' is not allowed; "
                                              "expected one of 'cap', 'refuse', 'trust' (did you mean 'cap'?)"),
        (["aggregation.max_ratio_to_median=0.5"], "config key 'aggregation.max_ratio_to_median': must be >= 1, got 0.5"),
        (
            ["aggregation.max_weight_share=0.3", "plugins.client_send=[{name: secagg}]"],
            "config key 'aggregation.max_weight_share': plugin 'secagg' combines updates while encoded",
        ),
    ],
)
def test_attack_and_claim_settings_are_checked_at_load(overrides: list[str], message: str) -> None:
    assert message in error_of(*overrides)


def test_attacks_and_claim_caps_load() -> None:
    config = config_mod.load(None, [
        "attacks.kind=[label_flip, inflate_examples]", "attacks.clients=[0, 3]", "aggregation.max_examples=500",
        "aggregation.max_weight_share=0.25",
    ])
    assert config.attacks.kinds == ["label_flip", "inflate_examples"] and config.attacks.clients == [0, 3]
    assert (config.aggregation.max_examples, config.aggregation.max_weight_share) == (500, 0.25)
    assert config_mod.load(None, []).attacks.kinds == []
    default = config_mod.load(None, []).aggregation
    assert (default.weight_policy, default.max_ratio_to_median) == ("cap", 3.0)  # bounded unless a run says trust


# --------------------------------------------------------------------------- switching a choice by override


def test_switching_the_strategy_drops_the_previous_ones_settings_with_a_note(caplog: pytest.LogCaptureFixture) -> None:
    data = {"strategy": {"name": "fedprox", "mu": 0.3}}
    with caplog.at_level("WARNING", logger="fedweave.config"):
        config = config_mod.from_dict(config_mod.apply_overrides(data, ["strategy.name=fedavg"]))
    assert config.strategy.name == "fedavg"
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == 1 and "dropped strategy.mu, settings of 'fedprox' that 'fedavg' does not have" in notes[0]
    assert data == {"strategy": {"name": "fedprox", "mu": 0.3}}  # the caller's data is untouched


def test_switching_keeps_the_settings_the_new_choice_declares_and_those_set_by_overrides() -> None:
    data = {"strategy": {"name": "fedadam", "server_lr": 0.5, "beta1": 0.8}}
    yogi = config_mod.from_dict(config_mod.apply_overrides(data, ["strategy.name=fedyogi"]))
    assert (yogi.strategy.name, yogi.strategy.params.server_lr, yogi.strategy.params.beta1) == ("fedyogi", 0.5, 0.8)
    start = {"strategy": {"name": "fedavg"}}
    before = config_mod.from_dict(config_mod.apply_overrides(start, ["strategy.mu=0.2", "strategy.name=fedprox"]))
    after = config_mod.from_dict(config_mod.apply_overrides(start, ["strategy.name=fedprox", "strategy.mu=0.2"]))
    assert before.strategy.params.mu == after.strategy.params.mu == 0.2


def test_switching_a_plugin_by_name_drops_its_settings(caplog: pytest.LogCaptureFixture) -> None:
    data = {"plugins": {"client_send": [{"name": "clip", "max_norm": 2.0}]}}
    with caplog.at_level("WARNING", logger="fedweave.config"):
        config = config_mod.from_dict(config_mod.apply_overrides(data, ["plugins.client_send.0.name=identity"]))
    assert [s.name for s in config.plugins.client_send] == ["identity"]
    assert "dropped plugins.client_send.0.max_norm" in caplog.text


def test_an_unknown_new_name_is_refused_as_before() -> None:
    with pytest.raises(ConfigError, match="config key 'strategy.name': unknown strategy 'fedavgg'"):
        config_mod.from_dict(
            config_mod.apply_overrides({"strategy": {"name": "fedprox", "mu": 0.3}}, ["strategy.name=fedavgg"])
        )


def test_task_kind_loss_and_metrics_are_checked_together() -> None:
    assert error_of("task.kind=regression", "task.metrics=[r2, accuracy]") == (
        "config key 'task.metrics': 'accuracy' is not a metric of kind regression; valid: mae, rmse, r2 "
        "or package.module:function"
    )
    assert error_of("task.kind=multilabel", "task.loss=cross_entropy") == (
        "config key 'task.loss': 'cross_entropy' is not a loss of kind multilabel; valid: bce or package.module:function"
    )
    assert error_of("task.kind=regression", "task.partition.scheme=dirichlet").startswith(
        "config key 'task.partition.scheme': dirichlet splits by class, a regression task has no classes"
    )
    assert error_of("task.metrics=[accuracy, a.b:accuracy]") == (
        "config key 'task.metrics': ['accuracy', 'a.b:accuracy'] records a metric twice"
    )
    config = config_mod.load(None, ["task.kind=regression", "task.partition=iid", "task.metrics=[r2, x.y:z]"])
    assert config.task.kind == "regression" and config.task.loss is None
