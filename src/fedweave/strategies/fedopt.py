"""FedOpt: FedAdam, FedYogi and FedAdagrad, adaptive server optimisers on the
pseudo-gradient (the averaged client delta).

Reddi et al., "Adaptive Federated Optimization", ICLR 2021.
https://arxiv.org/abs/2003.00295 (Algorithm 2)

One server step, for every floating tensor, with Δ the averaged client delta::

    m ← β1·m + (1 − β1)·Δ
    v ← adagrad: v + Δ²
        yogi:    v − (1 − β2)·Δ²·sign(v − Δ²)
        adam:    β2·v + (1 − β2)·Δ²
    x ← x + η·m / (√v + τ)

As in Algorithm 2, m starts at 0, v at τ² (the paper's ``v_{-1} ≥ τ²`` at equality),
and there is no bias correction. Running statistics (``plain_average``) take x + Δ, since
an adaptive step could push a variance below zero; integer tensors take the combined value.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from fedweave.schema import opt
from fedweave.strategies.aggregate import plain_average_option, step_floats
from fedweave.strategies.base import StrategyContext
from fedweave.strategies.fedavg import FedAvgBase, FedAvgClient
from fedweave.types import Params, Update

SecondMoment = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``(v, Δ²) -> new v``."""


def adagrad_moment(v: torch.Tensor, d2: torch.Tensor) -> torch.Tensor:
    """``v + Δ²``."""
    return v + d2


def yogi_moment(v: torch.Tensor, d2: torch.Tensor, beta2: float) -> torch.Tensor:
    """``v − (1 − β2)·Δ²·sign(v − Δ²)``."""
    return v - (1 - beta2) * d2 * torch.sign(v - d2)


def adam_moment(v: torch.Tensor, d2: torch.Tensor, beta2: float) -> torch.Tensor:
    """``β2·v + (1 − β2)·Δ²``."""
    return beta2 * v + (1 - beta2) * d2


def adaptive_step(
    params: Params,
    delta: Params,
    m: Params,
    v: Params,
    second_moment: SecondMoment,
    *,
    lr: float,
    beta1: float,
    tau: float,
    plain_average: Sequence[str] = (),
) -> tuple[Params, Params, Params]:
    """One server step of Algorithm 2; absent moments start at m = 0, v = τ². Tensors
    matching ``plain_average`` take ``x + Δ``, integer ones the value in ``delta``.

    Returns the new parameters, first moments and second moments.
    """
    new_m: Params = {}
    new_v: Params = {}

    def step(name: str, p: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        new_m[name] = beta1 * m.get(name, torch.zeros_like(d)) + (1 - beta1) * d
        new_v[name] = second_moment(v.get(name, torch.full_like(d, tau * tau)), d * d)
        return p + lr * new_m[name] / (new_v[name].sqrt() + tau)

    new_params = step_floats(params, delta, plain_average, step)
    return new_params, new_m, new_v


@dataclass
class FedOptHParams:
    """Hyper-parameters of FedAdam and FedYogi."""

    server_lr: float = opt(0.1, gt=0, help="server learning rate η")
    beta1: float = opt(0.9, ge=0, lt=1, help="decay of the first moment")
    beta2: float = opt(0.99, ge=0, lt=1, help="decay (Adam) or update rate (Yogi) of the second moment")
    tau: float = opt(1e-3, gt=0, help="adaptivity τ: added to √v, and v starts at τ²")
    plain_average: list[str] = plain_average_option("adaptive step")


@dataclass
class FedAdagradHParams:
    server_lr: float = opt(0.1, gt=0, help="server learning rate η")
    beta1: float = opt(0.9, ge=0, lt=1, help="decay of the first moment")
    tau: float = opt(1e-3, gt=0, help="adaptivity τ: added to √v, and v starts at τ²")
    plain_average: list[str] = plain_average_option("adaptive step")


class AdaptiveSettings(Protocol):
    """What :func:`adaptive_step` reads of the hyper-parameters of all three."""

    server_lr: float
    beta1: float
    tau: float
    plain_average: list[str]


A = TypeVar("A", bound=AdaptiveSettings)


class _FedOpt(FedAvgBase[A]):
    """The server half shared by the three: average, then one :func:`adaptive_step`."""

    Client = FedAvgClient

    def __init__(self, hp: A, ctx: StrategyContext):
        super().__init__(hp, ctx)
        self.m: Params = {}
        self.v: Params = {}

    def aggregate(self, rnd: int, params: Params, updates: list[Update]) -> Params:
        delta = self.ctx.average([u.tensors for u in updates], [u.num_examples for u in updates])
        params, self.m, self.v = adaptive_step(
            params,
            delta,
            self.m,
            self.v,
            self.second_moment,
            lr=self.hp.server_lr,
            beta1=self.hp.beta1,
            tau=self.hp.tau,
            plain_average=self.hp.plain_average,
        )
        return params

    def second_moment(self, v: torch.Tensor, d2: torch.Tensor) -> torch.Tensor:
        """The new second moment from the old one and Δ²: each optimiser's own rule."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {"m": self.m, "v": self.v}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.m = dict(state["m"])
        self.v = dict(state["v"])


class FedAdam(_FedOpt[FedOptHParams]):
    """FedAdam (Reddi et al., 2021): Adam without bias correction on the server."""

    HParams = FedOptHParams

    def second_moment(self, v: torch.Tensor, d2: torch.Tensor) -> torch.Tensor:
        return adam_moment(v, d2, self.hp.beta2)


class FedYogi(_FedOpt[FedOptHParams]):
    """FedYogi (Reddi et al., 2021): Yogi's additive second-moment update on the server."""

    HParams = FedOptHParams

    def second_moment(self, v: torch.Tensor, d2: torch.Tensor) -> torch.Tensor:
        return yogi_moment(v, d2, self.hp.beta2)


class FedAdagrad(_FedOpt[FedAdagradHParams]):
    """FedAdagrad (Reddi et al., 2021): Adagrad (with first-moment decay β1) on the server."""

    HParams = FedAdagradHParams

    def second_moment(self, v: torch.Tensor, d2: torch.Tensor) -> torch.Tensor:
        return adagrad_moment(v, d2)
