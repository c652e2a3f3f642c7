"""FedProx: local training with a proximal term that keeps clients near the global model.

Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020.
https://arxiv.org/abs/1812.06127
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from fedweave.schema import opt
from fedweave.strategies.fedavg import FedAvgBase, FedAvgClient
from fedweave.training import ClientJob, LocalStep


@dataclass
class FedProxHParams:
    mu: float = opt(0.01, ge=0, help="weight μ of the proximal term μ/2·‖w − w_global‖² (0: FedAvg)")


def proximal(params: Mapping[str, torch.Tensor], anchor: Mapping[str, torch.Tensor], mu: float) -> torch.Tensor:
    """``μ/2 · Σ ‖w − anchor‖²`` over ``params`` (trainable parameters by name)."""
    total = sum(((p - anchor[name]) ** 2).sum() for name, p in params.items())
    return 0.5 * mu * torch.as_tensor(total)


class FedProxClient(FedAvgClient[FedProxHParams]):
    """Minimise ``loss + μ/2·‖w − w_t‖²`` with w_t the global model received this round."""

    def local_step(self, job: ClientJob) -> LocalStep:
        """The proximal term against the received parameters."""
        return LocalStep(penalty=self.penalty, anchor=job.instruction.params)

    def penalty(self, params: Mapping[str, torch.Tensor], anchor: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return proximal(params, anchor, self.hp.mu)


class FedProx(FedAvgBase[FedProxHParams]):
    """FedProx (Li et al., 2020): FedAvg's server step; clients add the proximal term
    against the current round's global model. ``train_loss`` reports the task loss alone.
    """

    HParams = FedProxHParams
    Client = FedProxClient
