"""What a plugin is, and each optional capability it may have, as small typed protocols.

Every plugin is a :class:`Plugin` (a name, the update kinds it accepts, whether the
server combines its payloads while encoded, ``encode`` and ``decode``), and declares for the
composition rules its stage, points, summability, need of one process and what it protects
in one typed class attribute, ``declares: ClassVar[Declaration]`` (:class:`Declaration`;
absent: ``Declaration()``). Beyond that a
plugin has a capability exactly when it has the methods of its protocol; the chains
(:mod:`fedweave.plugins.chain`) call it through the protocol, never by a looked-up
name, and :func:`check_plugin_class` refuses at load a class that has part of a
capability or declares one it lacks, with one line naming what is missing.

==================  ==============================================  ==========================
protocol            methods                                         when it is called
==================  ==============================================  ==========================
:class:`Combines`   ``combine(updates, ctx) -> Update``             a ``combines_encoded`` plugin
:class:`RunsProtocol`  ``setup``, ``combine(..., exchange)``       a combining plugin with its own
                                                                    control messages (SecAgg), server
:class:`Answers`    ``answer(control, ctx) -> Control``             its client half
:class:`SealsModel`  ``seal``, ``unseal``, ``check_encoded``,       a combining plugin that keeps the
                     ``sealed_bytes``                               global model encrypted (HE)
:class:`Stateful`   ``state_dict()``, ``load_state_dict(state)``    checkpoints (error feedback)
:class:`Binds`      ``bind(config)``                                once, when the run is built
:class:`BeginsRound`  ``begin_round(rnd, client_ids)``              before each round's set-up
:class:`Instructs`  ``instruct(ctx) -> dict``                       server, per instruction
:class:`Observes`   ``observe(updates)``                            server, on every update received
:class:`HearsFailures`  ``failed(failures)``                        server, the round's failed jobs
:class:`ReportsMetrics`  ``metrics() -> dict[str, float]``          after each round (also strategies)
:class:`DrawsFresh`  ``fresh_draws(params) -> FreshDraws | None``   at load, on the class (checkpoint
                                                                    cadence, :mod:`.compose`)
:class:`TakesOverTraining`  ``training(ctx) -> LocalTraining``    client, per training instruction
                                                                    (DP-SGD; one such plugin a run)
==================  ==============================================  ==========================
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar, runtime_checkable

from fedweave.errors import ConfigError
from fedweave.types import Control, Instruction, Params, Update, UpdateKind

if TYPE_CHECKING:
    from fedweave.training import LocalTraining
    from fedweave.federated.checks import Specs

POINTS = ("server_send", "client_receive", "client_send", "server_receive")
"""The four attachment points of a round's plugin chains (:mod:`fedweave.plugins.chain`)."""

Payload = TypeVar("Payload", Instruction, Update)


@dataclass(frozen=True)
class PluginContext:
    """Where a plugin runs: the round, the client the payload concerns, the side."""

    round: int
    client_id: int
    side: str  # "server" or "client"
    state: dict[str, Any] | None = field(default=None, compare=False)  # client side: its private plugin state
    config: Mapping[str, Any] = field(default_factory=dict, compare=False)  # client side: the instruction's config
    # what a decoded payload may hold (the run's update schema on the server, the model on a
    # client): a decoder refuses a layout of any other name, shape or dtype before it allocates
    expected: Specs | None = field(default=None, compare=False)


ControlExchange = Callable[[dict[int, Control]], dict[int, Control]]
"""Send each client id its control message; the answers of the clients that answered."""

STAGES = ("clip", "noise", "compress", "secure", "train")
"""A plugin's stages (:class:`Declaration`); within ``client_send`` the first four come in this order."""

PROTECTS = ("update", "training")
"""What a privacy plugin protects (:class:`Declaration`)."""


@dataclass(frozen=True)
class Declaration:
    """What a plugin class declares for the composition rules (:mod:`fedweave.plugins.compose`), as
    its ``declares: ClassVar[Declaration]``; a plugin that declares nothing has ``Declaration()``.

    - ``stage``: one of :data:`STAGES`, or None (a plugin of no stage);
    - ``points``: the attachment points where the plugin means something (None: any);
    - ``summable``: whether payloads it encoded for different clients can be summed entry by entry
      and decoded as one (a bool, or a function of the plugin's params giving one);
    - ``one_process``: why the plugin needs the server and the clients in one process (a string,
      or a function of its params giving one or None), or None;
    - ``protects``: what a privacy plugin protects, one of :data:`PROTECTS`, or None.
    """

    stage: str | None = None
    points: tuple[str, ...] | None = None
    summable: bool | Callable[[Any], bool] = False
    one_process: str | Callable[[Any], str | None] | None = None
    protects: str | None = None

    def is_summable(self, params: Any) -> bool:
        """Whether payloads encoded with ``params`` can be summed entry by entry."""
        return bool(self.summable(params) if callable(self.summable) else self.summable)

    def needs_one_process(self, params: Any) -> str | None:
        """Why a plugin with ``params`` needs the server and the clients in one process, or None."""
        return self.one_process(params) if callable(self.one_process) else self.one_process

    def problem(self) -> str | None:
        """What is wrong with this declaration (a value of the wrong type or out of its set), or None."""
        if self.stage is not None and self.stage not in STAGES:
            return f"stage must be one of {', '.join(STAGES)} or None, got {self.stage!r}"
        if self.points is not None and (
            not isinstance(self.points, tuple) or not self.points or any(p not in POINTS for p in self.points)
        ):
            return f"points must be a non-empty tuple of {', '.join(POINTS)}, or None, got {self.points!r}"
        if not (isinstance(self.summable, bool) or callable(self.summable)):
            return f"summable must be a bool or a function of the plugin's params, got {self.summable!r}"
        if not (self.one_process is None or isinstance(self.one_process, str) or callable(self.one_process)):
            return f"one_process must be a string, a function of the plugin's params, or None, got {self.one_process!r}"
        if self.protects is not None and self.protects not in PROTECTS:
            return f"protects must be one of {', '.join(PROTECTS)} or None, got {self.protects!r}"
        return None


NOTHING = Declaration()
"""The declaration of a plugin that declares nothing."""


def declaration(plugin: Any) -> Declaration:
    """What a plugin (class or instance) declares: its ``declares``, or :data:`NOTHING`
    (:func:`check_plugin_class` has refused one of another type when the config loaded)."""
    declared = getattr(plugin, "declares", NOTHING)
    return declared if isinstance(declared, Declaration) else NOTHING


@runtime_checkable
class Plugin(Protocol):
    """Every plugin: a transform of a payload on the wire and its inverse."""

    name: ClassVar[str]
    accepts: ClassVar[frozenset[UpdateKind]]
    combines_encoded: ClassVar[bool]

    def encode(self, payload: Payload, ctx: PluginContext) -> Payload: ...

    def decode(self, payload: Payload, ctx: PluginContext) -> Payload: ...


@runtime_checkable
class Combines(Protocol):
    """A combining plugin: the example-weighted mean of still-encoded updates, still encoded."""

    def combine(self, updates: list[Update], ctx: PluginContext) -> Update: ...


@runtime_checkable
class RunsProtocol(Protocol):
    """The server half of a combining plugin with its own control messages (secure aggregation's
    set-up and unmasking)."""

    def setup(self, rnd: int, cohort: list[int], exchange: ControlExchange) -> list[int]: ...

    def combine(self, updates: list[Update], ctx: PluginContext, exchange: ControlExchange) -> Update: ...


@runtime_checkable
class ChecksSummed(Protocol):
    """A plugin that precedes a combining one (``summable``): ``check_summed`` refuses, by raising
    ``ValueError``, a still-encoded update whose fields this plugin left (the floating ones as their
    layouts in the summed vector, the others in the clear) are not those it sends for the model's
    tensors (``expected``), so that one client's cannot fail the round's combine (server, on receipt)."""

    def check_summed(self, tensors: Params, expected: Specs) -> None: ...


@runtime_checkable
class Answers(Protocol):
    """The client half of such a plugin: its answer to each control message addressed to it."""

    def answer(self, control: Control, ctx: PluginContext) -> Control: ...


@runtime_checkable
class SealsModel(Protocol):
    """A combining plugin whose server keeps the global model encoded (HE): ``seal`` puts the
    encoded model in place of the plaintext params of each instruction (server), ``unseal``
    takes it back out (client, with the key), ``check_encoded`` refuses, by raising, a
    still-encoded update that could not be combined with the model (server); ``sealed_bytes``
    is the size of the largest message the encoded model of ``params`` makes (server, at start:
    checked against a transport's message limit)."""

    def seal(self, params: Params) -> Params: ...

    def unseal(self, tensors: Params) -> Params: ...

    def check_encoded(self, update: Update) -> None: ...

    def sealed_bytes(self, params: Params) -> int: ...


@runtime_checkable
class Stateful(Protocol):
    """State kept in checkpoints (error-feedback residuals, privacy ledgers)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class Binds(Protocol):
    def bind(self, config: Any) -> None: ...


@runtime_checkable
class BeginsRound(Protocol):
    def begin_round(self, rnd: int, client_ids: list[int]) -> None: ...


@runtime_checkable
class Instructs(Protocol):
    def instruct(self, ctx: PluginContext) -> dict[str, Any]: ...


@runtime_checkable
class Observes(Protocol):
    def observe(self, updates: list[Update]) -> None: ...


@runtime_checkable
class HearsFailures(Protocol):
    """Server side: the clients whose job failed (no reply: an error it reported, a refused
    instruction, a missed deadline, lost), by id with the reason, before their round's updates
    are received (a compressor then sends such a client the dense model next)."""

    def failed(self, failures: dict[int, str]) -> None: ...


@runtime_checkable
class ReportsMetrics(Protocol):
    """Numbers for the round's record (a plugin's ``epsilon``; a strategy's, as ``strategy_<key>``)."""

    def metrics(self) -> dict[str, float]: ...


@dataclass(frozen=True)
class FreshDraws:
    """What a plugin draws from the OS's secure source each round: a round done again draws it anew.
    ``releases``: each draw is a privacy release, so a round done twice is released twice."""

    what: str
    releases: bool


@runtime_checkable
class DrawsFresh(Protocol):
    """A plugin whose rounds draw from the OS's secure source (privacy noise, stochastic rounding,
    encryption): a resumed run that redoes a round does not repeat it. ``fresh_draws(params)``
    (a static method, asked of the class at load) says what it draws, or None where ``params``
    make the draws reproducible (``seeded_noise``) or there are none."""

    @staticmethod
    def fresh_draws(params: Any) -> FreshDraws | None: ...


@runtime_checkable
class TakesOverTraining(Protocol):
    """A client-side plugin that runs the round's local training in place of the plain loop
    (DP-SGD): ``training(ctx)`` is that client's training for ``ctx.round``, through which the
    strategy's client half trains (:mod:`fedweave.training`)."""

    def training(self, ctx: PluginContext) -> LocalTraining: ...


PARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("RunsProtocol and Answers", ("setup", "combine", "answer")),
    ("Stateful", ("state_dict", "load_state_dict")),
    ("SealsModel", ("seal", "unseal", "check_encoded", "sealed_bytes")),
)
"""Capabilities of several methods: a plugin with some of them must have all."""


def _has(obj: Any, method: str) -> bool:
    return callable(getattr(obj, method, None))


def check_plugin_class(cls: Any, key: str) -> None:
    """Refuse a plugin (class or instance) that breaks its contracts; ``key`` names the config key."""
    what = f"config key '{key}': plugin {getattr(cls, '__qualname__', type(cls).__qualname__)}"
    lacking = [m for m in ("encode", "decode") if not _has(cls, m)]
    lacking += [a for a in ("name", "accepts", "combines_encoded") if not hasattr(cls, a)]
    if lacking:
        raise ConfigError(f"{what} lacks {', '.join(lacking)} of the Plugin protocol (see docs/extending.md)")
    if not isinstance(cls.name, str) or not cls.name:
        raise ConfigError(f"{what}: its name must be a non-empty string, got {cls.name!r}")
    if not all(isinstance(k, UpdateKind) for k in cls.accepts):
        raise ConfigError(f"{what}: accepts must be a set of fedweave.types.UpdateKind, got {cls.accepts!r}")
    _check_declaration(cls, what)
    for protocol, methods in PARTS:
        present = [m for m in methods if _has(cls, m)]
        if protocol == "RunsProtocol and Answers" and present == ["combine"]:
            continue  # Combines, without a protocol of its own
        if present and len(present) < len(methods):
            missing = ", ".join(m for m in methods if m not in present)
            raise ConfigError(
                f"{what} has {', '.join(present)} but lacks {missing} of the {protocol} protocols (see docs/extending.md)"
            )
    if cls.combines_encoded and not _has(cls, "combine"):
        raise ConfigError(f"{what} declares combines_encoded = True but lacks combine(updates, ctx) (Combines protocol)")
    if _has(cls, "seal") and not cls.combines_encoded:
        raise ConfigError(f"{what} has seal(), which only a plugin that combines updates while encoded may have")
    if _has(cls, "setup") and not cls.combines_encoded:
        raise ConfigError(
            f"{what} has setup(), which runs only for a plugin that combines updates while encoded; "
            "set combines_encoded = True or drop setup"
        )


_DECLARED = tuple(f for f in Declaration.__dataclass_fields__)


def _check_declaration(cls: Any, what: str) -> None:
    """A plugin's ``declares`` is a :class:`Declaration` of valid values; nothing it declares stands
    beside it as a bare class attribute, which the rules would not read."""
    declared = getattr(cls, "declares", NOTHING)
    if not isinstance(declared, Declaration):
        raise ConfigError(
            f"{what}: declares must be a fedweave.plugins.contracts.Declaration, got {type(declared).__qualname__}"
        )
    problem = declared.problem()
    if problem is not None:
        raise ConfigError(f"{what}: its Declaration's {problem}")
    klass = cls if isinstance(cls, type) else type(cls)
    bare = [name for name in _DECLARED if hasattr(klass, name)]
    if bare:
        settings = ", ".join(f"{name}=..." for name in bare)
        raise ConfigError(
            f"{what} declares {', '.join(bare)} as class attributes, which the rules do not read; "
            f"declare them as declares = Declaration({settings}) (fedweave.plugins.contracts)"
        )
