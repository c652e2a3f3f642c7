"""A site's policy: which jobs it accepts, checked at the site before anything of the job runs.

The policy is the ``policy`` section of a site's file. Every rule is optional (absent: no
restriction) except ``code``, whose default is ``never``. :meth:`SitePolicy.check` reads the job's
config as plain data, *before* it is loaded: loading a config imports the ``package.module:Name``
objects it names, which runs code, so a job is judged on its raw keys. A key of the wrong shape is
refused by the rule that reads it, never trusted.

Rules are checked in the order of :data:`ORDER`; the first one a job breaks is its
:class:`Refusal`. A job never names a path on the site: ``task.dataset: files`` must read a
catalogue entry (``catalog:NAME``), and ``task.data_root`` and ``task.partition.file`` are refused,
whatever the policy says.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import typing
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from fedweave.errors import ConfigError
from fedweave.schema import opt, parse, to_dict

ORDER = (
    "code",
    "strategies",
    "plugins",
    "topologies",
    "catalog",
    "min_dp_noise",
    "require_secure_aggregation",
    "max_rounds",
    "max_local_epochs",
    "max_local_steps",
)
"""The order in which :meth:`SitePolicy.check` applies the rules."""

SECURE_AGGREGATION = ("secagg", "secagg+", "he")
"""What ``require_secure_aggregation`` may name: secagg (the plugin with every client as neighbour, full
SecAgg), secagg+ (the plugin with or without ``neighbours``), he (homomorphic encryption)."""

DP_PLUGINS = ("dp_local", "dp_central", "dpsgd")
"""The built-in plugins whose ``noise_multiplier`` counts for ``min_dp_noise``."""

CATALOG_PREFIX = "catalog:"
"""How a job names a catalogue entry (``task.dataset_options.path: catalog:NAME``)."""

CODE_KEYS = (
    "strategy.name",
    "selection.name",
    "task.dataset",
    "task.model",
    "task.loss",
    "task.metrics",
    "eval.fit_metrics_aggregation",
    "eval.evaluate_metrics_aggregation",
    "eval.server_function",
    "plugins",
)
"""The keys of a config that may name user code (``package.module:Name``, imported and run)."""

SITE_PATH_KEYS = ("task.data_root", "task.partition.file")
"""Keys besides the dataset's path that would make a site read a file of the job's choosing."""

PLUGIN_PATH_PARAMS = {"he": ("keys",)}
"""Built-in plugins' settings that name a path the site reads: ``he``'s ``keys``, the folder its clients
read the CKKS secret key from (a folder of the job's, its bundle's included, holds keys the job's author
made, who can then decrypt each site's update)."""

NOT_CODE_PREFIXES = ("torchvision:", CATALOG_PREFIX)
"""Values of ``task.dataset`` with a colon that name no module: built-in datasets and catalogue entries. At
every other key of :data:`CODE_KEYS` such a value is imported like any ``package.module:Name``."""

SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Refusal:
    """Why a site refuses a job: the policy key broken (``policy.strategies``) and a line saying
    what the job asked and what the site allows."""

    rule: str
    reason: str


SHOWN = 80
"""The most characters of a job's value a refusal's reason quotes (a reason goes to the audit logs and the
server, whatever the length of what a job wrote)."""


def _shown(value: Any) -> str:
    """``repr(value)``, cut to :data:`SHOWN` characters."""
    try:
        text = repr(value)
    except ValueError:  # an integer of more digits than Python writes
        return f"<{type(value).__name__} too long to show>"
    return text if len(text) <= SHOWN else text[: SHOWN - 3] + "..."


class _Malformed(Exception):
    """A job key has a shape no rule can judge; the rule reading it refuses the job."""


_MISSING = object()


def _get(job: Mapping[str, Any], dotted: str, default: Any) -> Any:
    """``job``'s value at ``dotted`` (``default`` when absent); a non-mapping on the way is malformed."""
    node: Any = job
    walked: list[str] = []
    for part in dotted.split("."):
        if not isinstance(node, Mapping):
            raise _Malformed(f"job key {'.'.join(walked) or '<root>'!r} is not a mapping ({_shown(node)})")
        walked.append(part)
        node = node.get(part, _MISSING)
        if node is _MISSING or node is None and default is not None:
            return default
    return node


def _named(value: Any, key: str, shorthand: str = "name") -> str:
    """The name of ``value`` (a string, or a mapping with ``shorthand``)."""
    if isinstance(value, Mapping):
        value = value.get(shorthand)
    if not isinstance(value, str):
        raise _Malformed(f"job key {key!r} names no {shorthand} ({_shown(value)})")
    return value


def plugin_specs(job: Mapping[str, Any]) -> list[tuple[str, str, Mapping[str, Any]]]:
    """``(key, name, settings)`` of every plugin the job applies, in attachment-point order."""
    plugins = _get(job, "plugins", {})
    if not isinstance(plugins, Mapping):
        raise _Malformed(f"job key 'plugins' is not a mapping ({_shown(plugins)})")
    from fedweave.config.sections import PluginsConfig

    points = [f.name for f in dataclasses.fields(PluginsConfig)]
    found = []
    for point, items in plugins.items():
        if point not in points:
            raise _Malformed(f"job key 'plugins' holds {_shown(point)}, not an attachment point ({', '.join(points)})")
        items = [] if items is None else items
        if not isinstance(items, list):
            raise _Malformed(f"job key 'plugins.{point}' is not a list ({_shown(items)})")
        for i, item in enumerate(items):
            key = f"plugins.{point}[{i}]"
            found.append((key, _named(item, key), item if isinstance(item, Mapping) else {}))
    return found


def user_code(job: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(key, reference)`` of every ``package.module:Name`` the job names: code a site would import."""

    def is_code(value: Any, key: str) -> bool:
        exempt = key == "task.dataset" and isinstance(value, str) and value.startswith(NOT_CODE_PREFIXES)
        return isinstance(value, str) and ":" in value and not exempt

    found = []
    for key in CODE_KEYS:
        if key == "plugins":
            found += [(k, name) for k, name, _ in plugin_specs(job) if is_code(name, key)]
            continue
        section, _, field = key.partition(".")
        if field == "name":  # strategy and selection: a name, or a mapping with one
            value = _get(job, section, None)
            value = value.get("name") if isinstance(value, Mapping) else value
        else:
            value = _get(job, key, None)
        values = value if isinstance(value, list) else [value]
        found += [(key, v) for v in values if is_code(v, key)]
    return found


def _data_reference(job: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """``(entry, refusal)``: the catalogue entry a job reads, or why its ``task.dataset: files`` reads none."""
    dataset = _get(job, "task.dataset", None)
    if isinstance(dataset, str) and dataset.startswith(CATALOG_PREFIX):
        return dataset[len(CATALOG_PREFIX):], None
    if dataset != "files":
        return None, None
    path = _get(job, "task.dataset_options.path", None)
    if isinstance(path, str) and path.startswith(CATALOG_PREFIX):
        return path[len(CATALOG_PREFIX):], None
    named = "no path" if path is None else f"task.dataset_options.path {_shown(path)}"
    return None, (
        f"the job reads task.dataset: files with {named}; a job names a site's data by catalogue entry "
        "(catalog:NAME), never by a path on the site"
    )


def _step_counts(job: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """``(key, steps)`` of every setting that sets a client's local steps per round in place of
    ``local.epochs``: ``local.steps``, Ditto's ``strategy.personal_steps`` (the personal model's steps, taken
    after the global model's local work), and the adaptive controller's ``max_steps`` (None: no limit) when it
    adjusts steps (it gives each client the steps its speed allows, between min_steps and max_steps)."""
    found = []
    steps = _get(job, "local.steps", None)
    if steps is not None:
        found.append(("local.steps", steps))
    strategy = _get(job, "strategy", None)
    if isinstance(strategy, Mapping) and strategy.get("name") == "ditto" and strategy.get("personal_steps") is not None:
        found.append(("strategy.personal_steps", strategy["personal_steps"]))
    controller = _get(job, "controller", None)
    controller = {"kind": controller} if isinstance(controller, str) else controller
    if controller is not None and not isinstance(controller, Mapping):
        raise _Malformed(f"job key 'controller' is not a mapping ({_shown(controller)})")
    if controller and controller.get("kind") == "adaptive" and controller.get("adjust", "steps") == "steps":
        found.append(("controller.max_steps", controller.get("max_steps")))
    return found


@functools.cache
def _defaults() -> dict[str, Any]:
    """The defaults of the keys the rules read, from the config schema itself."""
    from fedweave.config import Config

    config = Config()
    return {"rounds": config.rounds, "local.epochs": config.local.epochs, "strategy.name": config.strategy.name,
            "topology.kind": config.topology.kind}


def _listing(names: Collection[str]) -> str:
    return ", ".join(sorted(names)) or "none"


@dataclass(frozen=True)
class SitePolicy:
    """What a site accepts. Load it with :meth:`from_dict`; judge a job with :meth:`check`."""

    code: Literal["never", "any"] | list[str] = opt(
        "never",
        help="code bundles and package.module:Name references: never | any | a list of the sha256 of the "
        "bundles allowed (a job naming user code needs one of them)",
    )
    strategies: list[str] | None = opt(None, help="the strategy names a job may use (none: any)")
    plugins: list[str] | None = opt(None, help="the plugin names a job may use, every one listed (none: any)")
    topologies: list[str] | None = opt(None, help="the topology kinds a job may use (none: any)")
    catalog: list[str] | None = opt(None, help="the catalogue entries a job may read (none: any entry)")
    min_dp_noise: float | None = opt(
        None, ge=0, help="a job must apply dp_local, dp_central or dpsgd with at least this noise_multiplier"
    )
    require_secure_aggregation: str | list[str] | None = opt(
        None, help="secagg | secagg+ | he, or a list of them: a job must apply one"
    )
    max_rounds: int | None = opt(None, ge=1, help="the most rounds a job may run")
    max_local_epochs: int | None = opt(None, ge=1, help="the most local epochs per round")
    max_local_steps: int | None = opt(None, ge=1, help="the most local steps per round (local.steps)")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, key: str = "policy") -> SitePolicy:
        """The policy of ``data`` (a site file's ``policy`` section; None: the defaults), every key checked."""
        return parse(cls, dict(data) if isinstance(data, Mapping) else data, key)

    def validate(self, prefix: str) -> None:
        if isinstance(self.code, list):
            for i, digest in enumerate(self.code):
                if not SHA256.fullmatch(digest):
                    raise ConfigError(
                        f"config key '{prefix}.code[{i}]': expected a sha256 (64 lowercase hex digits), got {digest!r}"
                    )
        from fedweave.config.deployment import TopologyConfig
        from fedweave.plugins import PLUGINS
        from fedweave.strategies import STRATEGIES

        topologies = list(typing.get_args(typing.get_type_hints(TopologyConfig)["kind"]))
        for name, known in (("strategies", STRATEGIES.names()), ("plugins", PLUGINS.names()), ("topologies", topologies)):
            for i, value in enumerate(getattr(self, name) or []):
                if value not in known and (name == "topologies" or ":" not in value):
                    raise ConfigError(
                        f"config key '{prefix}.{name}[{i}]': {value!r} is not one of {', '.join(known)}"
                        + ("" if name == "topologies" else " or package.module:Name")
                    )
        if self.require_secure_aggregation == []:
            raise ConfigError(
                f"config key '{prefix}.require_secure_aggregation': an empty list requires nothing; name secagg, "
                "secagg+ or he, or leave the key out"
            )
        for i, value in enumerate(self._secure()):
            if value not in SECURE_AGGREGATION:
                at = f"[{i}]" if isinstance(self.require_secure_aggregation, list) else ""
                raise ConfigError(
                    f"config key '{prefix}.require_secure_aggregation{at}': {value!r} is not one of "
                    f"{', '.join(SECURE_AGGREGATION)}"
                )

    def check_entries(self, names: Collection[str], key: str = "policy") -> None:
        """A ConfigError naming ``key.catalog[i]`` when the policy lets jobs read an entry the site's catalogue
        (``names``) does not hold: a typo there would refuse every job that reads the entry meant."""
        for i, entry in enumerate(self.catalog or []):
            if entry not in names:
                raise ConfigError(
                    f"config key '{key}.catalog[{i}]': {entry!r} is not an entry of this site's catalogue "
                    f"({', '.join(sorted(names)) or 'none'})"
                )

    def _secure(self) -> list[str]:
        value = self.require_secure_aggregation
        return [] if value is None else [value] if isinstance(value, str) else list(value)

    def describe(self) -> dict[str, Any]:
        """The rules set (and ``code``, always), as plain data for the audit log and ``fedweave job``."""
        return {name: value for name, value in to_dict(self).items() if value is not None}

    def check(
        self, job: Mapping[str, Any], bundle_sha256: str | None, *, bundle_modules: Collection[str] | None = None
    ) -> Refusal | None:
        """The first rule of :data:`ORDER` that ``job`` (its config as plain data) breaks, or None.

        ``bundle_sha256``: the digest of the job's code bundle (None: no bundle). ``bundle_modules``: the
        top-level modules of the unpacked bundle (:func:`fedweave.federation.bundle.modules`); when given,
        every reference to user code must name one of them (unless ``code: any``)."""
        if not isinstance(job, Mapping):
            return Refusal("policy", f"the job is not a mapping of config keys ({type(job).__name__})")
        for rule in ORDER:
            try:
                reason = getattr(self, f"_check_{rule}")(job, bundle_sha256, bundle_modules)
            except _Malformed as exc:
                reason = str(exc)
            if reason is not None:
                return Refusal(f"policy.{rule}", reason)
        return None

    # One method per rule: the reason the job breaks it, or None.

    def _check_code(self, job: Mapping[str, Any], bundle: str | None, modules: Collection[str] | None) -> str | None:
        if self.code == "any":
            return None
        references = user_code(job)
        if bundle is not None and (self.code == "never" or bundle not in self.code):
            allowed = "no code bundle" if self.code == "never" else f"the bundles {_listing(self.code)}"
            return f"the job ships code bundle {bundle}; this site allows {allowed}"
        if references and bundle is None:
            key, reference = references[0]
            return (
                f"the job names user code {_shown(reference)} ({key}) without an allowed code bundle; this site "
                f"imports no code but its own built-ins (code: {self.code if self.code == 'never' else 'listed bundles'})"
            )
        if modules is not None:
            for key, reference in references:
                top = reference.partition(":")[0].partition(".")[0]
                if top not in modules:
                    return f"the job names {_shown(reference)} ({key}), whose module {_shown(top)} is not in its code bundle"
        return None

    def _check_strategies(self, job: Mapping[str, Any], *_: Any) -> str | None:
        if self.strategies is None:
            return None
        name = _named(_get(job, "strategy", _defaults()["strategy.name"]), "strategy")
        if name not in self.strategies:
            return f"the job asks strategy {_shown(name)}; this site accepts {_listing(self.strategies)}"
        return None

    def _check_plugins(self, job: Mapping[str, Any], *_: Any) -> str | None:
        if self.plugins is None:
            return None
        for key, name, _settings in plugin_specs(job):
            if name not in self.plugins:
                return f"the job applies plugin {_shown(name)} ({key}); this site accepts {_listing(self.plugins)}"
        return None

    def _check_topologies(self, job: Mapping[str, Any], *_: Any) -> str | None:
        if self.topologies is None:
            return None
        kind = _named(_get(job, "topology", _defaults()["topology.kind"]), "topology", "kind")
        if kind not in self.topologies:
            return f"the job asks topology {_shown(kind)}; this site accepts {_listing(self.topologies)}"
        return None

    def _check_catalog(self, job: Mapping[str, Any], *_: Any) -> str | None:
        entry, refusal = _data_reference(job)
        if refusal is not None:
            return refusal
        for key in SITE_PATH_KEYS:
            value = _get(job, key, None)
            if value is not None:
                return f"the job names {key} {_shown(value)}, a path on the site; a job reads a site's data by catalogue entry"
        for key, name, settings in plugin_specs(job):
            for option in PLUGIN_PATH_PARAMS.get(name, ()):
                if settings.get(option) is not None:
                    return (
                        f"the job names {key}.{option} {_shown(settings[option])}, a path on the site (for {name!r}: the "
                        "folder of the secret key, which whoever made it can decrypt with); a job names no path on a site"
                    )
        if entry is not None and self.catalog is not None and entry not in self.catalog:
            return f"the job reads catalogue entry {_shown(entry)}; this site lets jobs read {_listing(self.catalog)}"
        return None

    def _check_min_dp_noise(self, job: Mapping[str, Any], *_: Any) -> str | None:
        if self.min_dp_noise is None:
            return None
        from fedweave.plugins import PLUGINS

        noises, seeded = [], []
        for key, name, settings in plugin_specs(job):
            if name in DP_PLUGINS:
                default = PLUGINS.get(name, key).HParams.__dataclass_fields__["noise_multiplier"].default
                noise = settings.get("noise_multiplier", default)
                if isinstance(noise, bool) or not isinstance(noise, (int, float)) or not math.isfinite(noise):
                    raise _Malformed(f"job key '{key}.noise_multiplier' is not a finite number ({_shown(noise)})")
                if settings.get("seeded_noise", False) is not False:
                    seeded.append(key)
                    continue
                noises.append(float(noise))
        if not noises and seeded:
            return (
                f"the job's noise is seeded ({seeded[0]}.seeded_noise): drawn from the run seed in the config, it "
                f"can be drawn again and subtracted; this site needs noise_multiplier >= {self.min_dp_noise:g} "
                "from fresh draws"
            )
        if not noises:
            return f"the job applies no differential privacy; this site needs noise_multiplier >= {self.min_dp_noise:g}"
        if max(noises) < self.min_dp_noise:
            return f"the job's noise_multiplier is {max(noises):g}; this site needs >= {self.min_dp_noise:g}"
        return None

    def _check_require_secure_aggregation(self, job: Mapping[str, Any], *_: Any) -> str | None:
        required = self._secure()
        if not required:
            return None
        present = set()
        for _key, name, settings in plugin_specs(job):
            if name == "secagg":
                present.add("secagg+")
                if settings.get("neighbours") is None:
                    present.add("secagg")
            elif name == "he":
                present.add("he")
        if present.isdisjoint(required):
            applied = _listing(present) if present else "no secure aggregation"
            return f"the job applies {applied}; this site needs {' or '.join(required)}"
        return None

    def _check_max_rounds(self, job: Mapping[str, Any], *_: Any) -> str | None:
        return self._ceiling(job, "rounds", self.max_rounds)

    def _check_max_local_epochs(self, job: Mapping[str, Any], *_: Any) -> str | None:
        if self.max_local_epochs is None:
            return None
        counted = _step_counts(job)
        if counted and self.max_local_steps is None:
            key, steps = counted[0]
            return (
                f"the job trains {key}={_shown(steps)} per round, which a ceiling on epochs cannot bound; this "
                f"site allows at most {self.max_local_epochs} local epochs (set max_local_steps to admit steps)"
            )
        return self._ceiling(job, "local.epochs", self.max_local_epochs)

    def _check_max_local_steps(self, job: Mapping[str, Any], *_: Any) -> str | None:
        if self.max_local_steps is None:
            return None
        for key, steps in _step_counts(job):
            if steps is None:
                return (
                    f"the job leaves {key} unset, so a client's local steps per round have no limit; this site "
                    f"allows at most {self.max_local_steps}"
                )
            if isinstance(steps, bool) or not isinstance(steps, int):
                raise _Malformed(f"job key {key!r} is not an integer ({_shown(steps)})")
            if steps > self.max_local_steps:
                return f"the job asks {key}={_shown(steps)}; this site allows at most {self.max_local_steps}"
        return None

    @staticmethod
    def _ceiling(job: Mapping[str, Any], key: str, ceiling: int | None) -> str | None:
        if ceiling is None:
            return None
        value = _get(job, key, _defaults().get(key))
        if isinstance(value, bool) or not isinstance(value, int):
            raise _Malformed(f"job key {key!r} is not an integer ({_shown(value)})")
        if value > ceiling:
            return f"the job asks {key}={_shown(value)}; this site allows at most {ceiling}"
        return None
