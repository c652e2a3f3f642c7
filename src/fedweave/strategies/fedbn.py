"""FedBN: BatchNorm layers stay local, everything else is FedAvg.

Li, Jiang, Zhang, Kamp, Dou, "FedBN: Federated Learning on Non-IID Features via Local
Batch Normalization", ICLR 2021. https://arxiv.org/abs/2102.07623
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from fedweave.strategies.fedavg import FedAvgBase, FedAvgClient
from fedweave.strategies.fedper import aggregate_shared, keep_local, restore_local, shared_schema
from fedweave.training import ClientJob, train_local
from fedweave.federated.checks import UpdateSchema
from fedweave.types import Evaluation, Params, Update

log = logging.getLogger(__name__)


@dataclass
class FedBNHParams:
    """FedBN has no hyper-parameters beyond the local training settings."""


def batch_norm_keys(model: nn.Module) -> list[str]:
    """State-dict names of every BatchNorm module: weight, bias, running_mean, running_var, num_batches_tracked."""
    keys: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, _BatchNorm):
            keys.extend(module.state_dict(prefix=f"{name}." if name else ""))
    return keys


class FedBNClient(FedAvgClient[FedBNHParams]):
    """Train with this client's own BatchNorm layers; send the delta of all other layers."""

    def __init__(self, hp: FedBNHParams):
        super().__init__(hp)
        self.warned = False

    def train(self, job: ClientJob) -> Update:
        keys = batch_norm_keys(job.model)
        if not keys and not self.warned:
            log.warning("model %s has no BatchNorm layer: FedBN is FedAvg", type(job.model).__name__)
            self.warned = True
        restore_local(job)
        return keep_local(job, keys, train_local(job))

    def evaluate(self, job: ClientJob) -> Evaluation:
        restore_local(job)
        return super().evaluate(job)


class FedBN(FedAvgBase[FedBNHParams]):
    """FedBN (Li et al., ICLR 2021): FedAvg on every layer except BatchNorm, which each client keeps.

    Layers are found by module type (``torch.nn.modules.batchnorm._BatchNorm``: BatchNorm1d/2d/3d,
    SyncBatchNorm), not by name. The global model keeps its initial BatchNorm layers, so FedBN is
    judged by federated (personalised) evaluation on the clients' local test splits.
    """

    HParams = FedBNHParams
    Client = FedBNClient

    @staticmethod
    def update_schema(model: nn.Module, hp: FedBNHParams) -> UpdateSchema:
        """Every state-dict entry but those of BatchNorm layers."""
        return shared_schema(model, batch_norm_keys(model))

    def aggregate(self, rnd: int, params: Params, updates: list[Update]) -> Params:
        return aggregate_shared(params, updates, self.ctx.average)
