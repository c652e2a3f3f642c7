"""The strategy protocol: a server half and a client half.

The server half turns the controller's plan into instructions (:meth:`Strategy.configure`)
and folds the clients' updates into new global parameters (:meth:`Strategy.aggregate`).
When its averaging rule discarded whole updates (Krum), ``aggregate`` returns the new
parameters as a :class:`~fedweave.strategies.aggregate.Selected` naming the updates it
kept (``apply_delta`` and ``step_floats`` pass on the rule's, as
:func:`~fedweave.strategies.aggregate.with_selection` does for other steps), and
only those count as applied; plain ``Params`` mean it applied them all.
Its state (server optimiser moments, control variates, ...) is saved in checkpoints
through ``state_dict`` / ``load_state_dict``.

The client half (``Strategy.Client``) trains and evaluates on a client's data. State a
client keeps across rounds (control variates, a personal model) lives in
``job.state``: the runtime restores it before the call and keeps it afterwards, keyed
by client id, so one client object can serve any number of clients; it commits the new
state only once the server has applied the round's update (:mod:`fedweave.federated.client`).

A strategy also declares, for the config validator:

- ``HParams``: a dataclass of its hyper-parameters (bounds in field metadata);
- ``update_kind``: what its clients send (weights, delta, gradient);
- a constructor ``(hp: HParams, ctx: StrategyContext)``;
- optionally ``check_config(config)``, a static method that refuses impossible
  settings when the config loads (e.g. FedNova with a local optimiser other than SGD),
  and ``check_model(model, hp)``, which refuses a model it cannot train before round 1
  (MOON needs ``features``/``head``, FedPer patterns that match parameters);
- optionally ``private_extras(hp)``, a static method saying what the tensors its clients
  send in ``extras`` are computed from, when that is their data: ``("data", what)``
  (from the raw data, as SCAFFOLD option I's full gradient) or ``("update", what)``
  (from the trained model, as SCAFFOLD option II's Δc). Extras bypass the ``client_send``
  chain, so the privacy plugins they would escape are refused at load
  (:mod:`fedweave.plugins.compose`); extras that only restate what every update reports
  in the clear (FedNova's a_i, from the step count) need no declaration;
- ``weighted_sum``: whether its server step only needs the weighted sum of the
  updates, so plugins that aggregate while encoded (secure aggregation, homomorphic
  encryption) can be used with it;
- ``metrics() -> dict[str, float]`` (:class:`~fedweave.plugins.contracts.ReportsMetrics`),
  optional: numbers of the round just aggregated (a server step's norm), recorded in
  metrics.jsonl as ``strategy_<key>``;
- ``update_schema(model, hp)`` (:class:`DeclaresUpdate`), a static method, when its
  clients send other than every entry of the model's state dict without extras: the
  tensors and ``extras`` its updates hold. The server rejects any update that does not
  match (:mod:`fedweave.federated.checks`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

from torch import nn

from fedweave.strategies.aggregate import weighted_average
from fedweave.training import ClientJob, LocalStep, TrainResult
from fedweave.types import Evaluation, Instruction, Params, Update, UpdateKind, Work
from fedweave.federated.checks import UpdateSchema

Average = Callable[[Sequence[Params], Sequence[float]], Params]


@dataclass
class StrategyContext:
    """What the server half of a strategy is built with besides its hyper-parameters.

    ``average`` is the rule that combines the clients' tensors: the weighted mean by
    default, a robust rule (median, trimmed mean, Krum) when the config's
    ``aggregation.rule`` asks for one. Strategies whose server step averages updates
    call it instead of :func:`~fedweave.strategies.aggregate.weighted_average`. A rule
    that discards inputs (Krum) returns a :class:`~fedweave.strategies.aggregate.Selected`.
    """

    num_clients: int
    seed: int = 0
    average: Average = weighted_average


class ClientAlgorithm(Protocol):
    """The client half of a strategy."""

    def train(self, job: ClientJob) -> Update: ...

    def evaluate(self, job: ClientJob) -> Evaluation: ...


@runtime_checkable
class Vectorisable(Protocol):
    """A client half whose round is plain local optimisation of the shared model: its step is what
    ``local_step`` declares, its update what ``finish`` makes of the trained model's change. The
    simulation may then train a cohort of its clients as one vectorised computation
    (:mod:`fedweave.cohort`); its own ``train`` must be ``local_step`` → :func:`train_local` →
    ``finish`` (a subclass that overrides ``train`` alone runs sequentially)."""

    def local_step(self, job: ClientJob) -> LocalStep: ...

    def finish(self, job: ClientJob, result: TrainResult, delta: Params) -> Update: ...


@runtime_checkable
class ReadsInstruction(Protocol):
    """A client half that reads keys of its own in each instruction's ``config`` (set by its server
    half's ``configure``), beyond those that change local training; it checks their values itself.
    The client runtime refuses any key that no part of the client reads (:mod:`fedweave.federated.client`)."""

    instruction_keys: ClassVar[frozenset[str]]


@runtime_checkable
class ReportsTraining(Protocol):
    """A client half whose updates carry metrics beyond ``train_loss``; each name starts with
    ``train_`` and is recorded per round as the example-weighted mean of the updates that carry it.
    A metric no client half declares is refused on the client (:mod:`fedweave.federated.client`)."""

    train_metrics: ClassVar[frozenset[str]]


def training_metrics(client: Any) -> frozenset[str]:
    """The names of the metrics the updates of a client half (its class or an instance) carry:
    ``train_loss`` and those it declares, each checked to start with ``train_``."""
    declared = client.train_metrics if isinstance(client, ReportsTraining) else frozenset()
    for name in declared:
        if not (isinstance(name, str) and name.startswith("train_")):
            raise ValueError(
                f"{getattr(client, '__qualname__', type(client).__qualname__)}.train_metrics: {name!r} does not "
                "start with 'train_', the records' names of training metrics"
            )
    return frozenset({"train_loss", *declared})


H_co = TypeVar("H_co", covariant=True)
"""A strategy's hyper-parameters (a dataclass)."""


class Strategy(Protocol[H_co]):
    """The server half of a strategy, whose hyper-parameters are a ``H_co`` (``HParams``)."""

    @property
    def HParams(self) -> type[H_co]:
        """The dataclass of its hyper-parameters."""
        ...

    Client: ClassVar[type]
    update_kind: ClassVar[UpdateKind]
    weighted_sum: ClassVar[bool]

    def configure(self, rnd: int, params: Params, plan: list[Work]) -> list[Instruction]: ...

    def aggregate(self, rnd: int, params: Params, updates: list[Update]) -> Params: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class DeclaresUpdate(Protocol):
    """A strategy whose updates hold other than every state-dict entry of the model and no
    extras (personal layers kept on the clients, control variates, normalising factors)."""

    @staticmethod
    def update_schema(model: nn.Module, hp: Any) -> UpdateSchema:
        """The tensors and extras each client update of this strategy holds."""
        ...


@runtime_checkable
class ChecksConfig(Protocol):
    """A strategy that refuses settings of other sections when the config loads (FedNova: SGD only)."""

    @staticmethod
    def check_config(config: Any) -> None:
        """Raise a one-line ConfigError naming the key for a setting this strategy cannot work with."""
        ...


@runtime_checkable
class ChecksModel(Protocol):
    """A strategy that refuses a model it cannot train, before round 1 (MOON needs ``features``/``head``)."""

    @staticmethod
    def check_model(model: nn.Module, hp: Any) -> None:
        """Raise a one-line error naming what the model lacks."""
        ...
