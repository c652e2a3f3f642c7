"""SCAFFOLD: control variates that correct the client drift of local SGD.

Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated
Learning", ICML 2020. https://arxiv.org/abs/1910.06378 (Algorithm 1)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from fedweave.errors import ConfigError
from fedweave.schema import opt
from fedweave.strategies.aggregate import (
    kept_indices,
    plain_average_option,
    step_floats,
    weighted_average,
    with_selection,
)
from fedweave.strategies.base import StrategyContext
from fedweave.strategies.fedavg import FedAvgBase, FedAvgClient
from fedweave.strategies.fednova import normalizing_factor
from fedweave.training import ClientJob, LocalStep, TrainResult, delta_update
from fedweave.types import Instruction, Params, TaskKind, Update, Work
from fedweave.federated.checks import UpdateSchema, specs_of

CONTROL = "control"
"""The key of the client's control variate c_i in ``job.state``."""
JOINT = "__control_delta."
"""Prefix of the control deltas in a robust rule's joint pass over (Δy_i, Δc_i)."""


@dataclass
class ScaffoldHParams:
    option: Literal["I", "II"] = opt(
        "II", help="client control variate update: I = gradient at the global model, II = from the local steps"
    )
    global_lr: float = opt(1.0, gt=0, help="server step size η_g on the averaged model delta")
    plain_average: list[str] = plain_average_option("η_g step")


def full_gradient(job: ClientJob) -> Params:
    """∇f_i(x) for option I: the mean gradient of the client's whole training data at the
    received parameters (mini-batches of the round's batch size, a mean-reducing loss), whatever
    the model holds when called. The model is left in the received state, so buffers are untouched."""
    model = job.model
    model.load_state_dict(job.instruction.params)
    model.train()
    model.zero_grad(set_to_none=True)
    n = job.x_train.shape[0]
    batch = min(job.instruction.work.batch_size, n)
    for start in range(0, n, batch):
        x, y = job.x_train[start : start + batch], job.y_train[start : start + batch]
        (job.loss_fn(model(x), y) * (len(x) / n)).backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    model.load_state_dict(job.instruction.params)
    return grads


def option_two(control: Params, server_control: Params, delta: Params, steps: float, lr: float) -> Params:
    """c_i⁺ = c_i − c + (x − y_i)/(K·η_l), with ``delta`` = y_i − x and K = ``steps``."""
    return {
        name: control[name] - server_control[name] - delta[name] / (steps * lr) for name in control
    }


class ScaffoldClient(FedAvgClient[ScaffoldHParams]):
    """Local steps on ``g − c_i + c``; sends Δy in ``tensors`` and Δc = c_i⁺ − c_i in ``extras``.

    c_i is kept in ``job.state`` (zeros the first time), c arrives in
    ``instruction.extras`` (zeros when absent); both cover the trainable parameters.
    In option II, η_l is ``local.lr`` and K the effective number of steps: the local
    steps for plain SGD (the paper), FedNova's a_i = Σ_t (1 − ρ^t)/(1 − ρ) with
    momentum ρ, since momentum moves the model ~1/(1 − ρ) times further per gradient.
    """

    def local_step(self, job: ClientJob) -> LocalStep:
        """The step on ``g − c_i + c``."""
        control, server_control = self._controls(job)
        return LocalStep(correction={name: server_control[name] - control[name] for name in control})

    def finish(self, job: ClientJob, result: TrainResult, delta: Params) -> Update:
        """Δy and Δc = c_i⁺ − c_i; c_i⁺ kept in the client's state."""
        control, server_control = self._controls(job)
        if self.hp.option == "I":
            start_gradient = full_gradient(job)
            new_control = {name: start_gradient.get(name, torch.zeros_like(c)) for name, c in control.items()}
        else:
            new_control = option_two(
                control, server_control, delta, normalizing_factor(result.steps, job.settings.momentum), job.settings.lr
            )
        job.state[CONTROL] = new_control
        return delta_update(result, delta, {name: new_control[name] - control[name] for name in control})

    def _controls(self, job: ClientJob) -> tuple[Params, Params]:
        """c_i (zeros the first time) and c (zeros where absent), over the trainable parameters."""
        zeros = {name: torch.zeros_like(p) for name, p in job.model.named_parameters() if p.requires_grad}
        control = job.state.get(CONTROL, zeros)
        return control, {name: job.instruction.extras.get(name, zeros[name]) for name in zeros}


class Scaffold(FedAvgBase[ScaffoldHParams]):
    """SCAFFOLD (Karimireddy et al., 2020), server half::

        x ← x + η_g · mean_w(Δy_i)          (weights: num_examples, as FedAvg)
        c ← c + (|S|/N) · mean(Δc_i)        (uniform, as the paper)

    With a robust aggregation rule, both means become one pass of the rule over the
    clients' joined (Δy_i, Δc_i), so Krum keeps the same clients for both; S is then the
    clients it kept, the only ones whose new c_i the loop lets them commit.

    The x step weights clients by their examples like FedAvg, which is the paper's
    uniform mean when clients hold equal data; so the first round, with zero control
    variates and η_g = 1, is FedAvg exactly. The c step is the paper's uniform mean, so
    c stays the mean of all N clients' c_i under partial participation. Running
    statistics (``plain_average``) take x + mean_w(Δy), whatever η_g.
    """

    HParams = ScaffoldHParams
    Client = ScaffoldClient
    weighted_sum = False

    @staticmethod
    def check_config(config: Any) -> None:
        """Option II derives the control variate from local SGD steps: refuse other optimisers at load."""
        if config.strategy.params.option == "II" and config.local.optimizer != "sgd":
            raise ConfigError(
                f"config key 'local.optimizer': SCAFFOLD option II computes control variates from local SGD "
                f"steps; {config.local.optimizer!r} needs strategy.option=I"
            )

    @staticmethod
    def update_schema(model: nn.Module, hp: ScaffoldHParams) -> UpdateSchema:
        """Δy of every state-dict entry; Δc of every trainable parameter, in ``extras``."""
        trainable = {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}
        return UpdateSchema(specs_of(model.state_dict()), specs_of(trainable))

    @staticmethod
    def private_extras(hp: ScaffoldHParams) -> tuple[str, str]:
        """What Δc_i in ``extras`` is computed from, for the privacy rules at load
        (:mod:`fedweave.plugins.compose`): it never passes the client_send chain."""
        if hp.option == "I":
            return "data", "Δc_i = ∇f_i(x) − c_i, the exact gradient of its whole training set (strategy.option I)"
        return "update", "Δc_i = −c − Δy_i/(K·η_l), from which the un-noised Δy_i comes back (strategy.option II)"

    def __init__(self, hp: ScaffoldHParams, ctx: StrategyContext):
        super().__init__(hp, ctx)
        self.control: Params = {}

    def configure(self, rnd: int, params: Params, plan: list[Work]) -> list[Instruction]:
        return [
            Instruction(round=rnd, task=TaskKind.TRAIN, work=w, params=params, extras=self.control) for w in plan
        ]

    def aggregate(self, rnd: int, params: Params, updates: list[Update]) -> Params:
        if self.ctx.average is weighted_average:
            delta = weighted_average([u.tensors for u in updates], [u.num_examples for u in updates])
            control_delta = weighted_average([u.extras for u in updates], [1.0] * len(updates))
        else:
            delta, control_delta = self._robust_deltas(updates)
        share = len(kept_indices(delta, len(updates))) / self.ctx.num_clients
        self.control = {
            name: self.control.get(name, torch.zeros_like(d)) + share * d for name, d in control_delta.items()
        }
        lr = self.hp.global_lr
        stepped = step_floats(params, delta, self.hp.plain_average, lambda name, p, d: p + lr * d)
        return stepped

    def _robust_deltas(self, updates: list[Update]) -> tuple[Params, Params]:
        """One pass of the robust rule over each client's (Δy_i, Δc_i) together.

        A rule that selects clients (Krum) then takes the model and the control-variate
        delta of the same clients, and scores them on both; a coordinate-wise rule
        (median, trimmed mean) is unchanged by the joining. The selected clients' control
        deltas are weighted by examples like their model deltas (the paper's uniform mean
        where clients hold equal data). The model delta names the clients the rule kept.
        """
        joined = [{**u.tensors, **{JOINT + k: v for k, v in u.extras.items()}} for u in updates]
        both = self.ctx.average(joined, [u.num_examples for u in updates])
        delta = with_selection(both, {k: v for k, v in both.items() if not k.startswith(JOINT)})
        return delta, {k[len(JOINT):]: v for k, v in both.items() if k.startswith(JOINT)}

    def state_dict(self) -> dict[str, Any]:
        return {"control": self.control}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.control = dict(state["control"])
