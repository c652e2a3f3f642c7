"""Every composition rule of a run, in one place, checked when the config loads.

A rule relates two or more families of a run: strategy, aggregation rule, plugins,
topology, transport, launcher. Each section of the config checks its own keys (see
:mod:`fedweave.config`); what one section allows that another then forbids is a rule
here, so that a config that loads, runs. :func:`check` runs every rule of
:data:`RULES` in order and the first broken one raises a one-line
:class:`~fedweave.errors.ConfigError` that names the key and says what is allowed.

Two families declare part of their own rules, which the rules here call:

- a strategy may have ``check_config(config)`` (a static method): settings it refuses,
  such as FedNova with a local optimiser other than SGD (:func:`strategy_settings`);
- a plugin declares where it may stand and in what order (``points``, ``stage``,
  ``summable``, ``one_process``), read by :mod:`fedweave.plugins.compose`
  (:func:`plugin_order`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fedweave.config.root import emulates_clients
from fedweave.errors import ConfigError
from fedweave.plugins.compose import check_chains, configured
from fedweave.plugins.contracts import BeginsRound, SealsModel, check_plugin_class, declaration

RING_OBSERVERS = ("fedavg", "fedprox")
"""Strategies whose server step is the plain example-weighted mean: a ring's observer."""

MEAN_DELTA_STEPS = ("fedavg", "fedprox")
"""Strategies whose server step is w + the example-weighted mean delta: the step a server takes on an
encrypted model (plugin he)."""


def _strategy(config: Any) -> Any:
    from fedweave.strategies import STRATEGIES

    return STRATEGIES.get(config.strategy.name, "strategy.name")


def _plugins(config: Any) -> list[tuple[str, int, Any, Any]]:
    """``(point, index, spec, class)`` of every configured plugin, in chain order."""
    from fedweave.plugins import PLUGINS

    return list(configured(config, PLUGINS))


LAYER_STRATEGIES = {
    "moon": "contrasts the model's representation layer",
    "fedper": "keeps the model's head layers personal",
    "fedbn": "keeps the model's batch-norm layers personal",
}
"""Strategies that work on a model's layers rather than elementwise on its named tensors."""


def adapter_strategies(config: Any) -> None:
    """LoRA adapters are named tensors that every elementwise strategy averages, steps or robustly
    combines; a strategy that works on the model's layers has none of them to work on."""
    if config.task.peft.method is None or config.mode != "federated":
        return
    why = LAYER_STRATEGIES.get(config.strategy.name)
    if why is not None:
        raise ConfigError(
            f"config key 'strategy.name': {config.strategy.name} {why}, but task.peft trains and sends LoRA "
            "adapters only; use an elementwise strategy (fedavg, fedprox, fedadam, scaffold, ditto, ...)"
        )


def launcher_transport(config: Any) -> None:
    """The process launcher runs every node as its own process, which needs a network transport."""
    if config.mode == "federated" and config.launcher.kind == "process" and config.transport.kind != "grpc":
        raise ConfigError(
            f"config key 'launcher': 'process' runs every node as its own process, which needs a "
            f"network transport; set transport: grpc (got {config.transport.kind!r})"
        )


def ray_launcher(config: Any) -> None:
    """The Ray launcher carries the clients' work to its actors itself, at their real speed."""
    if config.mode == "federated" and config.launcher.kind == "ray" and (
        config.transport.kind != "inmemory" or emulates_clients(config)
    ):
        raise ConfigError(
            "config key 'launcher': 'ray' carries the clients' work to Ray actors itself and runs them at "
            "their real speed; it needs transport inmemory and no heterogeneity emulation"
        )


def ring_transport(config: Any) -> None:
    """Ring gossip is simulated in one process."""
    if config.topology.kind == "ring" and config.transport.kind != "inmemory":
        raise ConfigError(
            "config key 'topology.kind': ring gossip runs in simulation (transport: inmemory); "
            f"got transport {config.transport.kind!r}"
        )


def ring_strategy(config: Any) -> None:
    """A ring has no server step: only a plain weighted mean can observe the nodes' consensus."""
    if config.topology.kind != "ring":
        return
    if config.strategy.name not in RING_OBSERVERS or config.aggregation.rule != "mean":
        raise ConfigError(
            "config key 'topology.kind': ring gossip needs a plain weighted-mean server to observe the "
            f"nodes' consensus ({', '.join(RING_OBSERVERS)} with aggregation.rule mean); got strategy "
            f"{config.strategy.name!r} with aggregation.rule {config.aggregation.rule!r}"
        )


def hierarchy_transport(config: Any) -> None:
    """A deployed hierarchy reaches site members over torch.distributed; ``outer`` is the server's link."""
    topo = config.topology
    if topo.kind == "hierarchical" and config.transport.kind == "grpc" and topo.inner != "torchdist":
        raise ConfigError(
            "config key 'topology.inner': a hierarchy deployed over gRPC reaches each site's members over "
            "torch.distributed; set topology.inner: torchdist (inmemory links exist only in simulation)"
        )
    if topo.outer is not None and topo.outer != config.transport.kind:
        raise ConfigError(
            f"config key 'topology.outer': {topo.outer!r} is the server's link, which is "
            f"transport: {config.transport.kind!r}; set transport: {topo.outer} (or leave outer unset)"
        )


def own_data_topology(config: Any) -> None:
    """Sites that read only their own data are deployed as a star: each client process reads its file."""
    task = config.task
    if task.dataset == "files" and config.transport.kind == "grpc" and config.topology.kind != "star":
        if task.file_options().per_site:
            raise ConfigError(
                "config key 'topology.kind': sites that read their own data (task.dataset: files with {client} "
                "in its path, or a client's --data) are deployed as a star; set topology.kind: star"
            )


def emulation_topology(config: Any) -> None:
    """Emulated client speeds exist only in the in-process star simulation."""
    if config.mode != "federated" or not emulates_clients(config):
        return
    if config.transport.kind == "grpc" and config.topology.kind == "star":
        if config.heterogeneity.clock == "virtual":
            raise ConfigError(
                "config key 'heterogeneity.clock': virtual is a simulation's clock; gRPC clients emulate their "
                "speeds by sleeping on the real clock (clock: real)"
            )
        return  # each client process sleeps to its speed (fedweave.nodes.client.run_client)
    if config.transport.kind != "inmemory" or config.topology.kind != "star":
        raise ConfigError(
            "config key 'heterogeneity': emulated client speeds need the in-process simulation (transport "
            "inmemory, topology star) or gRPC clients of a star; clients on real machines need no emulation"
        )


def strategy_settings(config: Any) -> None:
    """The strategy's own ``check_config``: settings of other sections it cannot work with."""
    from fedweave.strategies.base import ChecksConfig

    strategy = _strategy(config)
    if isinstance(strategy, ChecksConfig):
        strategy.check_config(config)


def krum_cohort(config: Any) -> None:
    """Krum tolerates f Byzantine clients among more than 2f + 2."""
    rule, f = config.aggregation.rule, config.aggregation.byzantine
    if rule in ("krum", "multi_krum") and config.clients_per_round <= 2 * f + 2:
        raise ConfigError(
            f"config key 'aggregation.byzantine': {rule} with f={f} needs more than "
            f"2f + 2 = {2 * f + 2} clients per round, the config samples {config.clients_per_round}"
        )


def plugin_contracts(config: Any) -> None:
    """Each plugin class has the methods of what it declares; names are unique in a chain."""
    names: dict[tuple[str, str], int] = {}
    for point, i, spec, cls in _plugins(config):
        check_plugin_class(cls, f"plugins.{point}[{i}]")
        name = getattr(cls, "name", spec.name)
        if (point, name) in names:
            raise ConfigError(
                f"config key 'plugins.{point}[{i}]': plugin name {name!r} is already plugins.{point}"
                f"[{names[point, name]}]; a chain decodes by name, so each plugin in it needs its own"
            )
        names[point, name] = i


def combining_plugins(config: Any) -> None:
    """A plugin that combines updates while encoded: client_send only, with a weighted-sum strategy."""
    strategy = _strategy(config)
    for point, i, spec, plugin in _plugins(config):
        key = f"config key 'plugins.{point}[{i}]'"
        if not plugin.combines_encoded:
            continue
        if point != "client_send":
            raise ConfigError(
                f"{key}: plugin {spec.name!r} combines client updates while encoded, so it belongs in "
                "plugins.client_send"
            )
        if config.aggregation.rule != "mean":
            raise ConfigError(
                f"{key}: plugin {spec.name!r} makes the server combine updates while encoded, so it only sees "
                f"their sum; aggregation.rule {config.aggregation.rule!r} needs each update in the clear"
            )
        if config.aggregation.max_weight_share is not None:
            raise ConfigError(
                f"config key 'aggregation.max_weight_share': plugin {spec.name!r} combines updates while "
                "encoded, with each weight inside its encoding, so the server cannot lower one; leave it unset"
            )
        if not strategy.weighted_sum:
            raise ConfigError(
                f"{key}: plugin {spec.name!r} makes the server combine updates while encoded, which needs a "
                f"weighted-sum server step; strategy {config.strategy.name!r} does not aggregate by a weighted sum"
            )


def sealed_model(config: Any) -> None:
    """A plugin that keeps the global model encrypted on the server (he) leaves it nothing to evaluate
    and no step but the clients' mean delta."""
    plugins = _plugins(config)
    for point, i, spec, plugin in plugins:
        if point != "client_send" or not isinstance(plugin, SealsModel):
            continue
        if config.eval.every:
            raise ConfigError(
                f"config key 'eval.every': plugin {spec.name!r} keeps the global model encrypted, so the server "
                "cannot evaluate it; set eval.every: 0 and evaluate on the clients (eval.federated_every: N)"
            )
        if config.strategy.name not in MEAN_DELTA_STEPS:
            raise ConfigError(
                f"config key 'strategy.name': plugin {spec.name!r} keeps the global model encrypted and steps it by "
                f"the clients' mean delta, the server step of {', '.join(MEAN_DELTA_STEPS)} only; got "
                f"{config.strategy.name!r}"
            )
        if config.topology.kind == "ring":
            raise ConfigError(
                f"config key 'topology.kind': plugin {spec.name!r} keeps the global model encrypted on a server, "
                "which a ring has not; use topology star or hierarchical"
            )
        if config.plugins.server_send:
            raise ConfigError(
                f"config key 'plugins.server_send': plugin {spec.name!r} broadcasts the global model encrypted, "
                "which no plugin can compress or transform; leave plugins.server_send empty"
            )
        for at, j, earlier, cls in plugins:
            if at == "client_send" and j < i and declaration(cls).stage == "compress":
                raise ConfigError(
                    f"config key 'plugins.client_send[{j}]': plugin {spec.name!r} adds every value of the update into "
                    f"the encrypted model, whose layout compression ({earlier.name!r}) changes; remove it"
                )


def update_kinds(config: Any) -> None:
    """Plugins on the uplink accept the kind of update the strategy sends."""
    strategy = _strategy(config)
    for point, i, spec, plugin in _plugins(config):
        if point in ("client_send", "server_receive") and strategy.update_kind not in plugin.accepts:
            kinds = ", ".join(sorted(k.value for k in plugin.accepts))
            raise ConfigError(
                f"config key 'plugins.{point}[{i}]': plugin {spec.name!r} accepts {kinds} updates, "
                f"but strategy {config.strategy.name!r} sends {strategy.update_kind.value}"
            )


def plugin_order(config: Any) -> None:
    """Where each plugin may stand and in what order, and the privacy rules: seeded noise only in
    simulation, no extras that bypass the privacy plugins (:mod:`fedweave.plugins.compose`)."""
    from fedweave.plugins import PLUGINS

    check_chains(config, PLUGINS, _strategy(config))


def attack_labels(config: Any) -> None:
    """A label-flipping attacker maps class y to C - 1 - y: a task without classes has none to flip."""
    if "label_flip" in config.attacks.kinds and config.task.kind != "classification":
        raise ConfigError(
            f"config key 'attacks.kind': label_flip flips class ids, a {config.task.kind} task has none; "
            "choose sign_flip, scaling, noise or inflate_examples"
        )


def per_client_evaluation(config: Any) -> None:
    """Per-client evaluation records name each client's score on its own data, which no privacy plugin covers."""
    if not config.eval.per_client:
        return
    for point, i, spec, plugin in _plugins(config):
        if declaration(plugin).protects:
            raise ConfigError(
                f"config key 'eval.per_client': each client's own metrics are not released under differential "
                f"privacy (plugins.{point}[{i}] is {spec.name!r}); drop per_client"
            )


def asynchronous_aggregation(config: Any) -> None:
    """Asynchronous aggregation scales each delta by its staleness and has no rounds to set up."""
    if not config.asynchronous.enabled:
        return
    strategy = _strategy(config)
    if strategy.update_kind.value != "delta":
        raise ConfigError(
            f"config key 'asynchronous.enabled': a stale update is scaled down, which needs delta updates; "
            f"strategy {config.strategy.name!r} sends {strategy.update_kind.value}"
        )
    for point, i, spec, plugin in _plugins(config):
        if plugin.combines_encoded or isinstance(plugin, BeginsRound):
            raise ConfigError(
                f"config key 'plugins.{point}[{i}]': plugin {spec.name!r} works per synchronous round "
                "(a cohort set up or accounted per round); asynchronous.enabled has no such rounds"
            )


def asynchronous_deployment(config: Any) -> None:
    """Deployed asynchronous aggregation gives each client its own job: a star of gRPC clients whose
    one job slot no federated evaluation may take in the middle of their training."""
    if config.mode != "federated" or not config.asynchronous.enabled or config.transport.kind == "inmemory":
        return
    if config.topology.kind != "star":
        raise ConfigError(
            f"config key 'topology.kind': asynchronous.enabled over {config.transport.kind} serves each client its "
            f"own job, which needs topology star (got {config.topology.kind!r})"
        )
    if config.launcher.kind not in ("local", "process"):
        raise ConfigError(
            f"config key 'launcher': asynchronous.enabled over gRPC runs with launcher local (fedweave server) or "
            f"process, not {config.launcher.kind!r}"
        )
    if config.eval.federated_every:
        raise ConfigError(
            "config key 'eval.federated_every': deployed asynchronous clients are always training; evaluate the "
            "global model on the server (eval.every) instead"
        )


RULES: tuple[Callable[[Any], None], ...] = (
    launcher_transport,
    ray_launcher,
    ring_transport,
    hierarchy_transport,
    own_data_topology,
    emulation_topology,
    plugin_contracts,
    strategy_settings,
    krum_cohort,
    ring_strategy,
    combining_plugins,
    sealed_model,
    update_kinds,
    plugin_order,
    asynchronous_aggregation,
    asynchronous_deployment,
    per_client_evaluation,
    attack_labels,
    adapter_strategies,
)
"""The rules, in the order they are checked (plugin classes first: later rules read them)."""


def check(config: Any) -> None:
    """Run every rule of :data:`RULES`; the first broken one raises its one-line ConfigError."""
    for rule in RULES:
        rule(config)
