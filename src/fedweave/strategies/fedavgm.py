"""FedAvgM: FedAvg with server momentum on the averaged client delta.

Hsu, Qi and Brown, "Measuring the Effects of Non-Identical Data Distribution for
Federated Visual Classification", 2019. https://arxiv.org/abs/1909.06335
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fedweave.schema import opt
from fedweave.strategies.aggregate import plain_average_option, step_floats
from fedweave.strategies.base import StrategyContext
from fedweave.strategies.fedavg import FedAvgBase, FedAvgClient
from fedweave.types import Params, Update


@dataclass
class FedAvgMHParams:
    server_lr: float = opt(1.0, gt=0, help="server learning rate applied to the momentum buffer")
    momentum: float = opt(0.9, ge=0, lt=1, help="server momentum (0: FedAvg with a server learning rate)")
    plain_average: list[str] = plain_average_option("momentum step")


def momentum_step(
    params: Params,
    delta: Params,
    velocity: Params,
    lr: float,
    momentum: float,
    plain_average: Sequence[str] = (),
) -> tuple[Params, Params]:
    """``v ← momentum·v + Δ``, ``x ← x + lr·v`` for every floating tensor; an absent
    velocity counts as zero. Tensors matching ``plain_average`` take ``x + Δ``; integer
    tensors take the value in ``delta``.

    Returns the new parameters and the new velocity.
    """
    new_velocity: Params = {}

    def step(name: str, p: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        v = velocity.get(name)
        new_velocity[name] = d.clone() if v is None else momentum * v + d
        return p + lr * new_velocity[name]

    new_params = step_floats(params, delta, plain_average, step)
    return new_params, new_velocity


class FedAvgM(FedAvgBase[FedAvgMHParams]):
    """FedAvgM (Hsu et al., 2019): ``v ← β·v + Δ̄``, ``x ← x + η·v`` with Δ̄ the
    example-weighted mean client delta (``ctx.average``).

    Running statistics (``plain_average``) take the plain average, since a momentum step
    could push a variance below zero. With ``momentum=0`` and ``server_lr=1`` it is FedAvg.
    """

    HParams = FedAvgMHParams
    Client = FedAvgClient

    def __init__(self, hp: FedAvgMHParams, ctx: StrategyContext):
        super().__init__(hp, ctx)
        self.velocity: Params = {}

    def aggregate(self, rnd: int, params: Params, updates: list[Update]) -> Params:
        delta = self.ctx.average([u.tensors for u in updates], [u.num_examples for u in updates])
        params, self.velocity = momentum_step(
            params, delta, self.velocity, self.hp.server_lr, self.hp.momentum, self.hp.plain_average
        )
        return params

    def state_dict(self) -> dict[str, Any]:
        return {"velocity": self.velocity}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.velocity = dict(state["velocity"])
