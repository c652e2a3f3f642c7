"""FedDyn: a dynamic regulariser that aligns the clients' stationary points with the
global one.

Acar et al., "Federated Learning Based on Dynamic Regularization", ICLR 2021.
https://arxiv.org/abs/2111.04263 (Algorithm 1)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fedweave.schema import opt
from fedweave.strategies.aggregate import kept_indices, plain_average_option, step_floats
from fedweave.strategies.base import StrategyContext
from fedweave.strategies.fedavg import FedAvgBase, FedAvgClient
from fedweave.training import ClientJob, delta_update, model_delta, train_local
from fedweave.types import Params, Update

LINEAR = "linear"
"""The key of the client's ∇L_k(θ_k^{t-1}) in ``job.state``."""


@dataclass
class FedDynHParams:
    alpha: float = opt(0.01, gt=0, help="weight α of the dynamic regulariser")
    plain_average: list[str] = plain_average_option("h-corrected step")


def dynamic_regularizer(model: nn.Module, linear: Params, anchor: Params, alpha: float) -> torch.Tensor:
    """``−⟨g, θ⟩ + α/2·‖θ − θ^{t−1}‖²`` over the trainable parameters, g = ``linear``."""
    return torch.as_tensor(
        sum(
            0.5 * alpha * ((p - anchor[name]) ** 2).sum() - (linear[name] * p).sum()
            for name, p in model.named_parameters()
            if p.requires_grad
        )
    )


def server_step(
    params: Params, delta: Params, h: Params, alpha: float, share: float, plain_average: Sequence[str] = ()
) -> tuple[Params, Params]:
    """``h ← h − α·share·Δ̄`` and ``θ ← θ + Δ̄ − h/α`` for every floating tensor, where
    Δ̄ is the mean client delta (so θ + Δ̄ is the mean client model) and share = |P|/m.
    Tensors matching ``plain_average`` take ``θ + Δ̄``, integer ones the value in
    ``delta``. Returns the new parameters and h."""
    new_h: Params = {}

    def step(name: str, p: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        new_h[name] = h.get(name, torch.zeros_like(d)) - alpha * share * d
        return p + d - new_h[name] / alpha

    new_params = step_floats(params, delta, plain_average, step)
    return new_params, new_h


class FedDynClient(FedAvgClient[FedDynHParams]):
    """Minimise ``L_k(θ) − ⟨∇L_k(θ_k^{t−1}), θ⟩ + α/2·‖θ − θ^{t−1}‖²``, θ^{t−1} the received
    model; then ``∇L_k(θ_k^t) = ∇L_k(θ_k^{t−1}) − α(θ_k^t − θ^{t−1})`` (zeros at first),
    kept in ``job.state``."""

    def train(self, job: ClientJob) -> Update:
        anchor = job.instruction.params
        alpha = self.hp.alpha
        linear = job.state.get(LINEAR)
        if linear is None:
            linear = {name: torch.zeros_like(p) for name, p in job.model.named_parameters() if p.requires_grad}

        def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            task = job.loss_fn(model(x), y)
            return task + dynamic_regularizer(model, linear, anchor, alpha), task

        result = train_local(job, loss=loss)
        delta = model_delta(job.model, anchor)
        job.state[LINEAR] = {name: g - alpha * delta[name] for name, g in linear.items()}
        return delta_update(result, delta)


class FedDyn(FedAvgBase[FedDynHParams]):
    """FedDyn (Acar et al., 2021), server half, with m = ``ctx.num_clients`` and P the
    clients of the round whose updates are applied (a rule like Krum discards some)::

        h ← h − α·(1/m)·Σ_{k∈P} (θ_k − θ^{t−1})
        θ^t ← (1/|P|)·Σ_{k∈P} θ_k − h/α

    Means are uniform over clients, as in the paper (through ``ctx.average`` with equal
    weights). Running statistics (``plain_average``) take the plain mean with no h: the
    correction could push a variance below zero.
    """

    HParams = FedDynHParams
    Client = FedDynClient
    weighted_sum = False

    def __init__(self, hp: FedDynHParams, ctx: StrategyContext):
        super().__init__(hp, ctx)
        self.h: Params = {}

    def aggregate(self, rnd: int, params: Params, updates: list[Update]) -> Params:
        delta = self.ctx.average([u.tensors for u in updates], [1.0] * len(updates))
        share = len(kept_indices(delta, len(updates))) / self.ctx.num_clients
        params, self.h = server_step(params, delta, self.h, self.hp.alpha, share, self.hp.plain_average)
        return params

    def state_dict(self) -> dict[str, Any]:
        return {"h": self.h}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.h = dict(state["h"])
