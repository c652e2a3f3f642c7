"""FedProx: local training with a proximal term that keeps clients near the global model.

Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020.
https://arxiv.org/abs/1812.06127
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fedweave.schema import opt
from fedweave.strategies.fedavg import FedAvg, FedAvgClient
from fedweave.training import ClientJob, delta_update, model_delta, train_local
from fedweave.types import Params, Update


@dataclass
class FedProxParams:
    mu: float = opt(0.01, ge=0, help="weight μ of the proximal term μ/2·‖w − w_global‖² (0: FedAvg)")


def proximal_term(model: nn.Module, anchor: Params, mu: float) -> torch.Tensor:
    """``μ/2 · Σ ‖w − anchor‖²`` over the model's trainable parameters."""
    total = sum(((p - anchor[name]) ** 2).sum() for name, p in model.named_parameters() if p.requires_grad)
    return 0.5 * mu * total


class FedProxClient(FedAvgClient):
    """Minimise ``loss + μ/2·‖w − w_t‖²`` with w_t the global model received this round."""

    def train(self, job: ClientJob) -> Update:
        anchor = job.instruction.params
        mu = self.hp.mu

        def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            task = job.loss_fn(model(x), y)
            return task + proximal_term(model, anchor, mu), task

        result = train_local(job, loss=loss)
        return delta_update(result, model_delta(job.model, anchor))


class FedProx(FedAvg):
    """FedProx (Li et al., 2020): FedAvg's server step; clients add the proximal term
    against the current round's global model. ``train_loss`` reports the task loss alone.
    """

    Params = FedProxParams
    Client = FedProxClient
