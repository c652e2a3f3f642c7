"""Whether a round's clients may train as a vectorised cohort, and if not, why.

Static reasons (:func:`static_reason`) are decided once per run: the strategy's client half must
be :class:`~fedweave.strategies.base.Vectorisable` without overriding ``train`` below the class
that declares its step; the model must draw no random numbers in training (dropout draws from
torch's global generator, one client after another); the loss must be a built-in mean over
examples (padding needs each example's loss). Per client (:func:`job_reason`): a plugin that
takes the loop over (DP-SGD) or a client without training rows trains on its own. ``cohort: auto``
also leaves a model with convolutions on a CPU to the sequential loop (:func:`auto_reason`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.dropout import _DropoutNd

from fedweave.strategies.base import ClientAlgorithm, Vectorisable
from fedweave.task.models import builtin_loss
from fedweave.training import SGD_LOOP, ClientJob, LossFn

PER_EXAMPLE = {"classification", "regression", "multilabel"}
"""Task kinds whose built-in losses are means of per-example losses (not language_model's
next-token loss, a mean over the tokens that are not padding)."""


def declares_step(algorithm: object) -> bool:
    """Whether ``algorithm`` is Vectorisable and its ``train`` is not overridden below the class
    that declares its ``local_step`` (FedBN, MOON override ``train`` of a Vectorisable parent)."""
    if not isinstance(algorithm, Vectorisable):
        return False
    mro = type(algorithm).__mro__
    trains = next(i for i, cls in enumerate(mro) if "train" in vars(cls))
    steps = next(i for i, cls in enumerate(mro) if "local_step" in vars(cls))
    finishes = next(i for i, cls in enumerate(mro) if "finish" in vars(cls))
    return trains >= min(steps, finishes)


def static_reason(algorithm: ClientAlgorithm, model: nn.Module, loss_fn: LossFn) -> str | None:
    """Why no client of this run can train in a cohort, or None."""
    name = type(algorithm).__qualname__
    if not declares_step(algorithm):
        return f"the strategy's client half {name} runs its own training loop (not Vectorisable)"
    if any(isinstance(m, _DropoutNd) for m in model.modules()):
        return "the model has dropout, whose random draws a cohort would not make as the sequential loop does"
    if not builtin_loss(loss_fn) or loss_fn.kind not in PER_EXAMPLE:
        return "the loss is not a built-in mean over examples (a user loss or the next-token loss)"
    return None


def auto_reason(model: nn.Module, device: torch.device) -> str | None:
    """Why ``cohort: auto`` leaves the clients one after another on ``device`` though they may train
    in cohorts, or None: on a CPU, ``vmap`` runs convolutions with per-client weights as grouped
    convolutions, slower than the clients' own (``benchmarks/cohort.py``: 0.5-1.1x for MNIST's CNN)."""
    if device.type == "cpu" and any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules()):
        return (
            "cohort auto on a CPU: the model's convolutions would run as grouped convolutions, slower than one "
            "client after another (simulation.cohort: K trains them in cohorts anyway)"
        )
    return None


def job_reason(job: ClientJob) -> str | None:
    """Why this client trains on its own this round, or None."""
    if job.training is not SGD_LOOP:
        return f"its training is taken over by a plugin ({type(job.training).__qualname__})"
    if job.x_train.shape[0] == 0:
        return "it has no training rows"
    if job.settings.optimizer not in ("sgd", "adam"):
        return f"a cohort steps sgd or adam, not {job.settings.optimizer}"
    return None
