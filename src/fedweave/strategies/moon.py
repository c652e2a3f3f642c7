"""MOON: local training pulled towards the global model's representation.

Li, He, Song, "Model-Contrastive Federated Learning", CVPR 2021.
https://arxiv.org/abs/2103.16257
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from fedweave.errors import TaskError
from fedweave.schema import opt
from fedweave.strategies.fedavg import FedAvgBase, FedAvgClient
from fedweave.training import ClientJob, delta_update, model_delta, train_local
from fedweave.types import Update


@dataclass
class MoonHParams:
    mu: float = opt(1.0, ge=0, help="weight μ of the model-contrastive term")
    temperature: float = opt(0.5, gt=0, help="temperature τ of the contrastive softmax")


def contrastive_loss(z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor, temperature: float) -> torch.Tensor:
    """ℓ_con = -log(e^{sim(z,z_glob)/τ} / (e^{sim(z,z_glob)/τ} + e^{sim(z,z_prev)/τ})); cosine sim, batch mean."""
    positive = F.cosine_similarity(z, z_glob, dim=-1) / temperature
    negative = F.cosine_similarity(z, z_prev, dim=-1) / temperature
    return (torch.logaddexp(positive, negative) - positive).mean()


@runtime_checkable
class Representation(Protocol):
    """A model that exposes its representation: ``features(x)`` (z) and ``head(z)`` (the logits)."""

    def features(self, x: torch.Tensor) -> torch.Tensor: ...

    def head(self, z: torch.Tensor) -> torch.Tensor: ...


def _representation(model: nn.Module) -> Representation:
    """``model`` as a :class:`Representation`, or a TaskError saying what it lacks."""
    if not (isinstance(model, Representation) and callable(model.features) and callable(model.head)):
        raise TaskError(
            f"strategy 'moon' needs a model with a representation: {type(model).__name__} must expose "
            "features(x) (the representation z) and head(z) (the logits), as the built-in mlp and cnn do"
        )
    return model


def _frozen(model: nn.Module, state: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """A copy of ``model`` (with ``state`` loaded) in eval mode, without gradients."""
    frozen = copy.deepcopy(model)
    if state is not None:
        frozen.load_state_dict(state)
    frozen.eval()
    frozen.requires_grad_(False)
    return frozen


class MoonClient(FedAvgClient[MoonHParams]):
    """Local training on task loss + μ·ℓ_con; the update is the trained model's delta.

    z comes from the trained model's ``features``, z_glob from a frozen copy of the
    received global model, z_prev from a frozen copy of this client's model after its
    previous local training (kept in ``job.state``; both copies in eval mode, as the
    official code). In a client's first round there is no previous model: ℓ_con would
    have only its positive term, which is identically 0 (the official code's one-logit
    cross-entropy), so that round is plain local training.
    """

    def train(self, job: ClientJob) -> Update:
        _representation(job.model)
        previous = job.state.get("previous")
        if previous is None:
            result = train_local(job)
        else:
            global_model = _representation(_frozen(job.model))
            previous_model = _representation(_frozen(job.model, previous))

            def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                trained = _representation(model)
                z = trained.features(x)
                task = job.loss_fn(trained.head(z), y)
                with torch.no_grad():
                    z_glob, z_prev = global_model.features(x), previous_model.features(x)
                return task + self.hp.mu * contrastive_loss(z, z_glob, z_prev, self.hp.temperature), task

            result = train_local(job, loss=loss)
        job.state["previous"] = {k: v.detach().clone() for k, v in job.model.state_dict().items()}
        return delta_update(result, model_delta(job.model, job.instruction.params))


class Moon(FedAvgBase[MoonHParams]):
    """MOON (Li et al., CVPR 2021): clients add the model-contrastive loss; the server is FedAvg."""

    HParams = MoonHParams
    Client = MoonClient

    @staticmethod
    def check_model(model: nn.Module, hp: MoonHParams) -> None:
        """MOON needs the model's representation: refuse a model without one before round 1."""
        _representation(model)
