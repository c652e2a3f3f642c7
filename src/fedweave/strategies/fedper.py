"""FedPer: shared base layers, personal layers that never leave the client.

Arivazhagan, Aggarwal, Singh, Choudhary, "Federated Learning with Personalization
Layers", 2019. https://arxiv.org/abs/1912.00818

The functions here serve every strategy whose clients keep some layers local
(FedPer by name patterns, FedBN by module type): the client overwrites the received
values of its local layers with its own, trains, keeps them, and sends the delta of
the shared layers only; the server averages the keys the updates carry and leaves
the others as they are.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Collection
from dataclasses import dataclass

from torch import nn

from fedweave.errors import TaskError
from fedweave.schema import opt
from fedweave.strategies.aggregate import apply_delta, with_selection
from fedweave.strategies.base import Average
from fedweave.strategies.fedavg import FedAvgBase, FedAvgClient
from fedweave.training import (
    ClientJob,
    TrainResult,
    delta_update,
    model_delta,
    train_local,
)
from fedweave.types import Evaluation, Params, Update
from fedweave.federated.checks import UpdateSchema, specs_of


@dataclass
class FedPerHParams:
    personal: list[str] = opt(
        factory=lambda: ["head.*"],
        help="glob patterns of state-dict names (parameters and buffers) that stay on each client",
    )


def restore_local(job: ClientJob) -> None:
    """Overwrite the received values of the client's local layers with its own (once it has them)."""
    local = job.state.get("local")
    if local:
        job.model.load_state_dict(local, strict=False)


def keep_local(job: ClientJob, keys: Collection[str], result: TrainResult) -> Update:
    """Store ``keys`` of the trained model in ``job.state``; the update is the delta of every other key."""
    trained = job.model.state_dict()
    job.state["local"] = {k: trained[k].detach().clone() for k in keys}
    delta = model_delta(job.model, job.instruction.params)
    return delta_update(result, {k: v for k, v in delta.items() if k not in keys})


def aggregate_shared(params: Params, updates: list[Update], average: Average) -> Params:
    """``params`` plus the average delta of the keys the updates carry; other keys keep their values.
    Names the updates the rule kept, as :func:`~fedweave.strategies.aggregate.with_selection` does."""
    delta = average([u.tensors for u in updates], [u.num_examples for u in updates])
    return with_selection(delta, {**params, **apply_delta({k: params[k] for k in delta}, delta)})


def shared_schema(model: nn.Module, local: Collection[str]) -> UpdateSchema:
    """What a client of a strategy that keeps the ``local`` entries sends: every other entry."""
    return UpdateSchema(specs_of({k: v for k, v in model.state_dict().items() if k not in local}))


def matching_keys(model: nn.Module, patterns: list[str]) -> list[str]:
    """State-dict names of ``model`` matched by any pattern; a pattern matching none is an error."""
    names = list(model.state_dict())
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            raise TaskError(
                f"strategy 'fedper': personal pattern {pattern!r} matches no parameter of "
                f"{type(model).__name__}; its names are {', '.join(names)}"
            )
    return [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]


class FedPerClient(FedAvgClient[FedPerHParams]):
    """Train the whole model with this client's personal layers; send the shared layers' delta."""

    def train(self, job: ClientJob) -> Update:
        keys = matching_keys(job.model, self.hp.personal)
        restore_local(job)
        return keep_local(job, keys, train_local(job))

    def evaluate(self, job: ClientJob) -> Evaluation:
        restore_local(job)
        return super().evaluate(job)


class FedPer(FedAvgBase[FedPerHParams]):
    """FedPer (Arivazhagan et al., 2019): FedAvg on the base layers; the server never touches personal ones.

    The global model's personal layers keep their initial values, so its accuracy on the
    global test set means little: FedPer is judged by federated (personalised) evaluation.
    """

    HParams = FedPerHParams
    Client = FedPerClient

    @staticmethod
    def check_model(model: nn.Module, hp: FedPerHParams) -> None:
        """Every personal-layer pattern must name a parameter: refuse a typo before round 1."""
        matching_keys(model, hp.personal)

    @staticmethod
    def update_schema(model: nn.Module, hp: FedPerHParams) -> UpdateSchema:
        """Every state-dict entry but the personal layers."""
        return shared_schema(model, matching_keys(model, hp.personal))

    def aggregate(self, rnd: int, params: Params, updates: list[Update]) -> Params:
        return aggregate_shared(params, updates, self.ctx.average)
