"""Composition rules of plugin chains, checked when the config is loaded (by :mod:`fedweave.rules`).

Plugins declare what the rules need in one typed class attribute, ``declares``, a
:class:`~fedweave.plugins.contracts.Declaration` (absent: ``Declaration()``, nothing declared):

- ``points``: the attachment points where the plugin means something (absent: any);
- ``stage``: ``clip``, ``noise``, ``compress`` or ``secure`` (masking, encryption);
  within ``client_send`` stages must come in that order;
- ``summable``: whether payloads it encoded for different clients can be summed
  entry by entry and decoded as one (a bool, or a function of the plugin's params).
  Only such plugins may come before a combining plugin (secure aggregation, HE,
  central DP), whose sum the earlier plugins decode;
- ``one_process``: why the plugin needs the server and the clients in one process
  (a string, or a function of its params giving one or None): state that a deployment
  would exchange in messages of its own, which the plugin does not send (as control
  messages, see :mod:`fedweave.plugins.chain`) yet. Such a plugin is refused with a
  transport other than ``inmemory``.

Privacy rules, for the plugins that declare ``protects`` (``"update"``: the update
that leaves a client is clipped and noised, ``dp_local``, ``dp_central``;
``"training"``: local training itself is private, ``dpsgd``):

- a plugin option ``seeded_noise: true`` draws the noise from the run seed, which every
  node reads in the config: refused unless every node runs in this one process;
- a strategy whose clients send tensors in ``extras`` computed from their data declares
  it (``private_extras(hp)``: ``("data", what)`` when computed from the raw data,
  ``("update", what)`` when computed from the trained model, which sample-level DP-SGD
  makes private but client_send's noise does not reach). Extras do not pass the
  ``client_send`` chain, so such a strategy is refused with the plugins they bypass.

Checkpoint cadence, for the plugins whose rounds draw from the OS's secure source
(:class:`~fedweave.plugins.contracts.DrawsFresh`): a run resumed from a checkpoint older
than its last round redoes the rounds since, and such a plugin draws them anew.

- ``checkpoint.min_interval > 0`` or ``checkpoint.every > 1`` with a plugin whose draws are
  privacy releases (``dp_local``, ``dp_central``, ``dpsgd`` without ``seeded_noise``) is
  refused: a round done again is a second release of it, which the privacy ledger, restored
  from the checkpoint, counts once. Their default ``min_interval`` is 0 (every round).
- with other such plugins (``secagg`` without ``seeded_noise``, ``he``) it is allowed with a
  logged warning: a resumed run's results differ slightly from an uninterrupted run's.

Control messages of a plugin's own protocol (secure aggregation's key set-up and
unmasking) need no rule: every topology and transport carries them.

Plugins that declare nothing (user plugins) are free, except that nothing may
follow a ``secure`` plugin and only summable plugins may precede a combining one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from fedweave.errors import ConfigError
from fedweave.plugins.contracts import POINTS, DrawsFresh, FreshDraws, TakesOverTraining, declaration

log = logging.getLogger(__name__)

ORDER = ("clip", "noise", "compress", "secure")

WHY_POINT = {
    "clip": "it bounds client updates, which only the client_send chain carries",
    "noise": "it adds privacy noise to client updates, which only the client_send chain carries",
    "compress": "it encodes at one end and decodes at the other, which only the send chains do",
    "secure": "it makes the server combine client updates while encoded",
    "train": "it sets up each client's private local training, which only instructions reaching a client carry",
}

WHY_ORDER = {
    ("noise", "clip"): "the noise is calibrated to the clip norm, so clipping must come first",
    ("compress", "clip"): "clipping bounds the update actually sent only when it comes before compression "
    "(compression rescales entries and error feedback adds residuals)",
    ("compress", "noise"): "compressing a noised update is post-processing and keeps the privacy guarantee, "
    "but noise added after compression protects an update whose norm is no longer bounded by the clip "
    "(rescaled entries, error-feedback residuals)",
}


def deployed(config: Any) -> str | None:
    """What runs this federation's nodes in processes of their own (each reading the config), or None."""
    if config.transport.kind != "inmemory":
        return f"transport {config.transport.kind!r}"
    if config.topology.kind == "hierarchical" and config.topology.inner != "inmemory":
        return f"topology.inner {config.topology.inner!r}"
    return None


def configured(config: Any, registry: Any) -> Iterator[tuple[str, int, Any, Any]]:
    """``(point, index, spec, class)`` of every configured plugin, in chain order; an unknown
    name raises (a ConfigError naming its key) when the walk reaches it."""
    for point in POINTS:
        for i, spec in enumerate(getattr(config.plugins, point)):
            yield point, i, spec, registry.get(spec.name, f"plugins.{point}[{i}].name")


def check_chains(config: Any, registry: Any, strategy: Any = None) -> None:
    """Raise a ConfigError for the first plugin placed or ordered against the rules."""
    compressors: dict[str, str] = {}  # point -> the compressor already in its chain
    trainer: str | None = None  # the plugin that takes over local training
    for point, i, spec, cls in configured(config, registry):
        if isinstance(cls, TakesOverTraining):
            if trainer is not None:
                raise ConfigError(
                    f"config key 'plugins.{point}[{i}]': plugin {spec.name!r} would take over local training, "
                    f"which {trainer!r} already does; one plugin of a run may"
                )
            trainer = spec.name
        declared = declaration(cls)
        if declared.stage == "compress":
            if point in compressors:
                raise ConfigError(
                    f"config key 'plugins.{point}[{i}]': plugin {spec.name!r} would compress what {compressors[point]!r} "
                    "already encoded, whose fields no codec reads back; one compressor per chain (top-k sends "
                    "its values at float16 or bfloat16 with its own 'values' option)"
                )
            compressors[point] = spec.name
        points = declared.points
        if points is not None and point not in points:
            where = " or ".join(f"plugins.{p}" for p in points)
            why = f"its class declares points = {tuple(points)!r}"
            stage = declared.stage
            if stage in WHY_POINT and (stage != "compress" or point in ("client_receive", "server_receive")):
                why = WHY_POINT[stage]
            raise ConfigError(f"config key 'plugins.{point}[{i}]': plugin {spec.name!r} belongs in {where}: {why}")
        reason = declared.needs_one_process(spec.params)
        if reason and (apart := deployed(config)):
            raise ConfigError(
                f"config key 'plugins.{point}[{i}]': plugin {spec.name!r} needs the server and the clients in "
                f"one process ({reason}); {apart} runs them apart"
            )
        _check_privacy(config, f"plugins.{point}[{i}]", spec, cls, strategy)
    _check_client_send(config.plugins.client_send, registry)
    _check_checkpoint(config, registry)


def fresh_draws(config: Any, registry: Any) -> list[tuple[str, str, FreshDraws]]:
    """``(config key, plugin name, what it draws)`` of each plugin whose rounds draw from the OS's secure source."""
    return [
        (f"plugins.{point}[{i}]", spec.name, draws)
        for point, i, spec, cls in configured(config, registry)
        if isinstance(cls, DrawsFresh) and (draws := cls.fresh_draws(spec.params)) is not None
    ]


def _check_checkpoint(config: Any, registry: Any) -> None:
    """A cadence that lets a resumed run redo rounds: refused with privacy releases, else a warning."""
    ckpt = config.checkpoint
    if ckpt.min_interval:
        key, value = "checkpoint.min_interval", f"{ckpt.min_interval:g} s"
    elif ckpt.every > 1:
        key, value = "checkpoint.every", str(ckpt.every)
    else:
        return
    for where, name, draws in fresh_draws(config, registry):
        if draws.releases:
            raise ConfigError(
                f"config key '{key}': {value} lets a resumed run redo the rounds since its last checkpoint, and plugin "
                f"{name!r} ({where}) draws fresh {draws.what} each round, so a round done again is a second privacy "
                f"release that the ledger restored from the checkpoint counts once; remove {key} (every round is "
                "checkpointed with such a plugin), or set its seeded_noise: true in a simulation"
            )
        log.warning(
            "%s %s: plugin %r (%s) draws fresh %s each round, so a run resumed from a checkpoint older than its "
            "last round redoes those rounds with other draws; its results differ slightly from an uninterrupted run's",
            key, value, name, where, draws.what,
        )


def _check_client_send(specs: list[Any], registry: Any) -> None:
    seen: list[tuple[int, str, Any]] = []
    for j, spec in enumerate(specs):
        key = f"config key 'plugins.client_send[{j}]'"
        cls = registry.get(spec.name, f"plugins.client_send[{j}].name")
        stage = declaration(cls).stage
        for i, name, earlier in seen:
            earlier_stage = declaration(earlier).stage
            if earlier_stage == "secure":
                raise ConfigError(
                    f"{key}: plugin {spec.name!r} comes after {name!r} (plugins.client_send[{i}]), which masks or "
                    "encrypts the update: nothing may follow it, since the server must combine exactly what was "
                    "masked or encrypted (put compression, clipping and noise before it)"
                )
            if cls.combines_encoded and earlier.combines_encoded:
                raise ConfigError(
                    f"{key}: plugins {name!r} (plugins.client_send[{i}]) and {spec.name!r} both make the server "
                    "combine the updates while encoded, and a round has one combine step (for differential "
                    "privacy with secure aggregation, put dp_local before secagg)"
                )
            if stage in ORDER and earlier_stage in ORDER and ORDER.index(earlier_stage) > ORDER.index(stage):
                raise ConfigError(
                    f"{key}: plugin {spec.name!r} ({stage}) comes after {name!r} ({earlier_stage}, "
                    f"plugins.client_send[{i}]); the order is clip, noise, compress, secure: "
                    f"{WHY_ORDER[(earlier_stage, stage)]}"
                )
        if cls.combines_encoded:
            for i, name, earlier in seen:
                params = specs[i].params
                if not declaration(earlier).is_summable(params):
                    hint = (
                        "use quantize with dtype float16 or bfloat16, or randk with shared_indices: true, "
                        "or compress the broadcast (server_send) instead"
                        if declaration(earlier).stage == "compress"
                        else "a plugin whose decode is linear can declare summable = True (declares = Declaration(summable=True))"
                    )
                    raise ConfigError(
                        f"config key 'plugins.client_send[{i}]': plugin {name!r} comes before {spec.name!r}, which "
                        f"sums the encoded updates, but payloads {name!r} encoded for different clients cannot be "
                        f"summed entry by entry (each has its own positions or scales); {hint}"
                    )
        seen.append((j, spec.name, cls))


def _check_privacy(config: Any, key: str, spec: Any, cls: Any, strategy: Any) -> None:
    where = deployed(config)
    if getattr(spec.params, "seeded_noise", False) and where is not None:
        raise ConfigError(
            f"config key '{key}.seeded_noise': plugin {spec.name!r} would draw its noise from the run seed, which "
            f"every node reads in the config, so the noise could be drawn again and subtracted; reproducible "
            f"noise is for simulation only, and {where} runs the nodes apart (remove seeded_noise)"
        )
    protects = declaration(cls).protects
    declare = getattr(strategy, "private_extras", None)
    leak = declare(config.strategy.params) if protects and declare is not None else None
    if leak is None:
        return
    source, what = leak
    if source == "data" or protects == "update":
        how = (
            "computed from the raw data, outside any private training"
            if source == "data"
            else "computed before client_send, so neither its clipping nor its noise reaches them; sample-level "
            "DP-SGD (dpsgd in plugins.client_receive) makes them post-processing of private training"
        )
        raise ConfigError(
            f"config key '{key}': plugin {spec.name!r} cannot protect what strategy {config.strategy.name!r} sends "
            f"in its extras: {what}, {how}"
        )
