"""FedNova: normalised averaging, so clients that take more local steps do not pull the
global model towards their own objective.

Wang et al., "Tackling the Objective Inconsistency Problem in Heterogeneous Federated
Optimization", NeurIPS 2020. https://arxiv.org/abs/2007.07481
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fedweave.errors import ConfigError
from fedweave.strategies.aggregate import (
    Selected,
    apply_delta,
    matches,
    plain_average_option,
    weighted_average,
    with_selection,
)
from fedweave.strategies.fedavg import FedAvgBase, FedAvgClient
from fedweave.training import PLAIN_STEP, ClientJob, LocalStep, TrainResult, delta_update
from fedweave.types import Params, Update
from fedweave.federated.checks import TensorSpec, UpdateSchema, specs_of

NORM = "fednova.a"
"""The key of the client's normalising factor a_i in ``Update.extras``."""


@dataclass
class FedNovaHParams:
    """a_i follows from the local SGD settings; only running statistics are configured."""

    plain_average: list[str] = plain_average_option("normalised step")


def normalizing_factor(steps: int, momentum: float) -> float:
    """‖a_i‖₁ of τ local SGD steps with momentum ρ: ``[τ − ρ(1 − ρ^τ)/(1 − ρ)] / (1 − ρ)``,
    which is τ without momentum (each step's gradient counted ``Σ_k ρ^k`` times)."""
    rho = momentum
    return (steps - rho * (1 - rho**steps) / (1 - rho)) / (1 - rho)


def effective_steps(factors: Sequence[float], weights: Sequence[float]) -> float:
    """τ_eff = Σ p_i a_i with p_i = w_i / Σ w."""
    return sum(w * a for w, a in zip(weights, factors)) / sum(weights)


def nova_scales(factors: list[float], weights: list[float]) -> list[float]:
    """τ_eff / a_i for every client."""
    tau_eff = effective_steps(factors, weights)
    return [tau_eff / a for a in factors]


def _scaled(tensors: Params, scale: float, plain_average: Sequence[str]) -> Params:
    return {
        k: v * scale if v.is_floating_point() and not matches(k, plain_average) else v
        for k, v in tensors.items()
    }


class FedNovaClient(FedAvgClient[FedNovaHParams]):
    """Local SGD as FedAvg; also sends a_i (from its steps and momentum) in ``extras``."""

    def local_step(self, job: ClientJob) -> LocalStep:
        """A plain SGD step; another optimiser is refused."""
        if job.settings.optimizer != "sgd":
            raise ValueError(
                f"FedNova normalises by the steps of local SGD; local.optimizer is {job.settings.optimizer!r}"
            )
        return PLAIN_STEP

    def finish(self, job: ClientJob, result: TrainResult, delta: Params) -> Update:
        """The delta and a_i."""
        a = normalizing_factor(result.steps, job.settings.momentum)
        return delta_update(result, delta, {NORM: torch.tensor(a, dtype=torch.float64)})


class FedNova(FedAvgBase[FedNovaHParams]):
    """FedNova (Wang et al., 2020), with Δ_i = y_i − x and p_i = n_i / Σ n::

        d_i = Δ_i / a_i,   τ_eff = Σ p_i a_i,   x ← x + τ_eff · Σ p_i d_i

    computed as the ``ctx.average`` of (τ_eff / a_i)·Δ_i, so equal a_i give FedAvg
    exactly. a_i covers plain SGD (a_i = τ_i) and SGD with momentum ρ (the formula of
    :func:`normalizing_factor`, as the official code's running counter). Weight decay,
    as in the official code, is part of the local gradient and leaves a_i unchanged.
    The local steps must be SGD (local Adam is refused). Running statistics
    (``plain_average``) take FedAvg's mean, unnormalised.

    With a robust aggregation rule, a_i is a client's claim like its example count, so
    τ_eff comes from the rule too: the clients Krum kept (Σ over them of p_i a_i,
    renormalised), or the median / trimmed mean of the a_i for the coordinate rules. A
    client claiming a huge a_i then cannot inflate everyone's step.
    """

    HParams = FedNovaHParams
    Client = FedNovaClient
    weighted_sum = False

    @staticmethod
    def check_config(config: Any) -> None:
        """FedNova's normalising factor counts local SGD steps: refuse other optimisers at load."""
        if config.local.optimizer != "sgd":
            raise ConfigError(
                f"config key 'local.optimizer': FedNova normalises by the steps of local SGD; "
                f"{config.local.optimizer!r} is not supported"
            )

    @staticmethod
    def update_schema(model: nn.Module, hp: FedNovaHParams) -> UpdateSchema:
        """Δ of every state-dict entry; a_i, one float64 number, in ``extras``."""
        return UpdateSchema(specs_of(model.state_dict()), {NORM: TensorSpec((), torch.float64)})

    def aggregate(self, rnd: int, params: Params, updates: list[Update]) -> Params:
        weights = [float(u.num_examples) for u in updates]
        factors = [float(u.extras[NORM]) for u in updates]
        scaled = [_scaled(u.tensors, s, self.hp.plain_average) for u, s in zip(updates, nova_scales(factors, weights))]
        delta = self.ctx.average(scaled, weights)
        if self.ctx.average is not weighted_average:  # the rule's τ_eff instead of every claim's
            tau = self._rule_steps(delta, factors, weights)
            delta = with_selection(delta, _scaled(delta, tau / effective_steps(factors, weights), self.hp.plain_average))
        return apply_delta(params, delta)

    def _rule_steps(self, delta: Params, factors: list[float], weights: list[float]) -> float:
        """τ_eff by the robust rule: over the updates it kept, or the rule applied to the a_i."""
        if isinstance(delta, Selected):
            kept = delta.kept
            return effective_steps([factors[i] for i in kept], [weights[i] for i in kept])
        claims = [{NORM: torch.tensor([a], dtype=torch.float64)} for a in factors]
        return float(self.ctx.average(claims, weights)[NORM])
