"""Ditto: a personal model per client, regularised towards the global FedAvg model.

Li, Hu, Beirami, Smith, "Ditto: Fair and Robust Federated Learning Through
Personalization", ICML 2021. https://arxiv.org/abs/2012.04228
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from fedweave.schema import opt
from fedweave.strategies.fedavg import FedAvgBase, FedAvgClient
from fedweave.training import ClientJob, delta_update, model_delta, train_local
from fedweave.types import Evaluation, Update


@dataclass
class DittoHParams:
    lam: float = opt(0.1, ge=0, help="λ of the personal objective F_k(v) + λ/2 ||v − w||²")
    personal_steps: int | None = opt(
        None, ge=1, help="local steps of the personal model per round (none: the same local work as the global model)"
    )


class DittoClient(FedAvgClient[DittoHParams]):
    """Train the global model as FedAvg (its delta is the update), then the personal model v_k.

    v_k lives in ``job.state`` and starts, in a client's first round, from the global
    model it receives. It takes local steps on ``loss(v) + λ/2 ||v − w||²``, where w is
    the round's received global model and the sum runs over trainable parameters; its
    buffers (BatchNorm statistics) are its own. Evaluation uses v_k when the client has one.
    """

    def train(self, job: ClientJob) -> Update:
        result = train_local(job)
        delta = model_delta(job.model, job.instruction.params)
        personal = copy.deepcopy(job.model)
        personal.load_state_dict(job.state.get("personal", job.instruction.params))
        anchor = job.instruction.params
        lam = self.hp.lam

        def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            task = job.loss_fn(model(x), y)
            pull = sum(((p - anchor[name]) ** 2).sum() for name, p in model.named_parameters() if p.requires_grad)
            return task + lam / 2 * pull, task

        train_local(self._personal_job(job), model=personal, loss=loss)
        job.state["personal"] = {k: v.detach().clone() for k, v in personal.state_dict().items()}
        return delta_update(result, delta)

    def evaluate(self, job: ClientJob) -> Evaluation:
        if "personal" in job.state:
            job.model.load_state_dict(job.state["personal"])
        return super().evaluate(job)

    def _personal_job(self, job: ClientJob) -> ClientJob:
        if self.hp.personal_steps is None:
            return job
        work = dataclasses.replace(job.instruction.work, local_steps=self.hp.personal_steps)
        return dataclasses.replace(job, instruction=dataclasses.replace(job.instruction, work=work))


class Ditto(FedAvgBase[DittoHParams]):
    """Ditto (Li et al., ICML 2021): the global model is FedAvg's; each client keeps a personal model."""

    HParams = DittoHParams
    Client = DittoClient
