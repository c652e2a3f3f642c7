"""A user strategy in a user module: FedAvg whose server learning rate decays every round.

    x_r = x_{r-1} + η_r · Σ n_k Δ_k / Σ n_k,    η_r = server_lr · decay^(r − 1)

A config selects it by its import path, with this folder on the Python path::

    strategy: {name: "custom_strategy:DecayedFedAvg", server_lr: 1.0, decay: 0.95}

    PYTHONPATH=examples fedweave run examples/custom-strategy.yaml

The three pieces every strategy has, in one file (docs/custom-strategy.md walks through them):

- ``DecayedFedAvgHParams``: its hyper-parameters, with bounds checked when the config loads;
- ``DecayedFedAvgClient``: the client half (train and evaluate on one client's data);
- ``DecayedFedAvg``: the server half (configure a round, aggregate the updates).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedweave.schema import opt
from fedweave.strategies.aggregate import plain_average_option, step_floats
from fedweave.strategies.base import StrategyContext
from fedweave.task import evaluate
from fedweave.training import ClientJob, delta_update, model_delta, train_local
from fedweave.types import Evaluation, Instruction, Params, TaskKind, Update, UpdateKind, Work


@dataclass
class DecayedFedAvgHParams:
    server_lr: float = opt(1.0, gt=0, help="server learning rate η_1 of the first round")
    decay: float = opt(0.95, gt=0, le=1, help="η_r = server_lr · decay^(r − 1); 1 keeps it constant")
    plain_average: list[str] = plain_average_option("decayed step")


class DecayedFedAvgClient:
    """Local SGD from the received global model; the update is the trained model minus it."""

    def __init__(self, hp: DecayedFedAvgHParams):
        self.hp = hp

    def train(self, job: ClientJob) -> Update:
        result = train_local(job)  # the round's work (epochs or steps) with the config's `local` optimiser
        return delta_update(result, model_delta(job.model, job.instruction.params))

    def evaluate(self, job: ClientJob) -> Evaluation:
        n = int(job.y_test.shape[0])
        if n == 0:  # a client too small for a local test split
            return Evaluation(num_examples=0, metrics={})
        return Evaluation(num_examples=n, metrics=evaluate(job.model, job.x_test, job.y_test, job.loss_fn))


class DecayedFedAvg:
    """FedAvg with a server learning rate ``server_lr · decay^(r − 1)`` in round r.

    The clients' deltas are combined by ``ctx.average`` (the example-weighted mean, or the
    config's robust ``aggregation`` rule), so the step is a scaled weighted sum and plugins
    that sum updates while encoded (secure aggregation) work with it. Running statistics
    (``plain_average``) take the plain mean: a scaled step is no average of variances.
    Integer buffers take the combined value. The rate follows from the round number, so
    there is no server state to checkpoint.
    """

    HParams = DecayedFedAvgHParams
    Client = DecayedFedAvgClient
    update_kind = UpdateKind.DELTA
    weighted_sum = True

    def __init__(self, hp: DecayedFedAvgHParams, ctx: StrategyContext):
        self.hp = hp
        self.ctx = ctx

    def server_lr(self, rnd: int) -> float:
        return self.hp.server_lr * self.hp.decay ** (rnd - 1)

    def configure(self, rnd: int, params: Params, plan: list[Work]) -> list[Instruction]:
        return [Instruction(round=rnd, task=TaskKind.TRAIN, work=w, params=params) for w in plan]

    def aggregate(self, rnd: int, params: Params, updates: list[Update]) -> Params:
        delta = self.ctx.average([u.tensors for u in updates], [u.num_examples for u in updates])
        lr = self.server_lr(rnd)
        # step_floats applies the step to floating tensors, the mean to plain_average ones,
        # and the clients' value to integer counters; it passes on which updates a rule such
        # as Krum kept, so only their clients count as applied.
        return step_floats(params, delta, self.hp.plain_average, lambda name, p, d: p + lr * d)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore: the rate is a function of the round."""
