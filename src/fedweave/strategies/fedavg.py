"""FedAvg: the example-weighted average of client updates.

McMahan et al., "Communication-Efficient Learning of Deep Networks from
Decentralized Data", AISTATS 2017. https://arxiv.org/abs/1602.05629
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

from fedweave.strategies.aggregate import apply_delta
from fedweave.strategies.base import StrategyContext
from fedweave.task.models import evaluate
from fedweave.training import (
    PLAIN_STEP,
    ClientJob,
    LocalStep,
    TrainResult,
    delta_update,
    model_delta,
    train_local,
)
from fedweave.types import (
    Evaluation,
    Instruction,
    Params,
    TaskKind,
    Update,
    UpdateKind,
    Work,
)


@dataclass
class FedAvgHParams:
    """FedAvg has no hyper-parameters beyond the local training settings."""


H = TypeVar("H")
"""The hyper-parameters (a dataclass) of a strategy built on FedAvg."""


class FedAvgClient(Generic[H]):
    """Train the received global model with local SGD and send back the delta.

    Its round is :class:`~fedweave.strategies.base.Vectorisable`: the step ``local_step`` declares
    (plain here; FedProx adds its penalty, SCAFFOLD its correction), the update ``finish`` makes of
    the delta (SCAFFOLD adds Δc, FedNova a_i)."""

    def __init__(self, hp: H):
        self.hp = hp

    def train(self, job: ClientJob) -> Update:
        step = self.local_step(job)
        result = train_local(job, **step.hooks(job.model, job.loss_fn))
        return self.finish(job, result, model_delta(job.model, job.instruction.params))

    def local_step(self, job: ClientJob) -> LocalStep:
        """A plain local step."""
        return PLAIN_STEP

    def finish(self, job: ClientJob, result: TrainResult, delta: Params) -> Update:
        """The delta, as it is."""
        return delta_update(result, delta)

    def evaluate(self, job: ClientJob) -> Evaluation:
        num_examples = int(job.y_test.shape[0])
        if num_examples == 0:  # a client too small for a local test split
            return Evaluation(num_examples=0, metrics={})
        return Evaluation(num_examples=num_examples, metrics=evaluate(job.model, job.x_test, job.y_test, job.loss_fn))


class FedAvgBase(Generic[H]):
    """FedAvg's server step for any hyper-parameters ``H``: the base of the strategies built on FedAvg,
    each of which names its ``HParams`` (a ``type[H]``, checked against ``H``) and usually its ``Client``."""

    HParams: type[H]
    Client: ClassVar[type[FedAvgClient[Any]]] = FedAvgClient
    update_kind: ClassVar[UpdateKind] = UpdateKind.DELTA
    weighted_sum: ClassVar[bool] = True

    def __init__(self, hp: H, ctx: StrategyContext):
        self.hp = hp
        self.ctx = ctx

    def configure(self, rnd: int, params: Params, plan: list[Work]) -> list[Instruction]:
        return [Instruction(round=rnd, task=TaskKind.TRAIN, work=w, params=params) for w in plan]

    def aggregate(self, rnd: int, params: Params, updates: list[Update]) -> Params:
        delta = self.ctx.average([u.tensors for u in updates], [u.num_examples for u in updates])
        return apply_delta(params, delta)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """FedAvg keeps no server state."""


class FedAvg(FedAvgBase[FedAvgHParams]):
    """FedAvg (McMahan et al., 2017): global ← global + Σ n_k Δ_k / Σ n_k."""

    HParams = FedAvgHParams
