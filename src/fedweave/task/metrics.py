"""Evaluation metrics of the task kinds: pure functions of a model's outputs and the targets.

Every metric is ``f(outputs, targets) -> float`` on a whole evaluation set, ``outputs`` being what the
model returns (logits for classification and multi-label, predictions for regression, per-token logits
for a language model):

- classification (``targets`` class ids): ``accuracy``, ``f1_macro`` (of the arg-max), ``auroc`` (of
  the softmax: the positive class's for two classes, else the mean one-vs-rest);
- multilabel (``targets`` 0/1 of shape (N, L)): ``accuracy`` (share of label decisions right),
  ``f1_macro`` (over labels, a logit > 0 predicting 1), ``auroc`` (mean over labels);
- regression (``targets`` (N,) or (N, k)): ``mae``, ``rmse``, ``r2`` (mean over targets);
- language_model (``targets`` token ids (N, T), ``IGNORE`` at padding): ``perplexity`` of the next token.

A class or label that no example holds, or that every example holds, has no F1 denominator or no
AUROC: F1 counts it as 0 (as scikit-learn does with ``zero_division=0``) when it is predicted or held,
AUROC leaves it out (NaN when none is left).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

MetricFn = Callable[[torch.Tensor, torch.Tensor], float]

IGNORE = -100
"""The target of a padding token: no loss, no perplexity (the convention of torch and transformers)."""

KINDS = ("classification", "regression", "multilabel", "language_model")
"""The task kinds (``task.kind``)."""


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    """Share of examples whose arg-max is the class id (classification), or of label decisions
    (logit > 0) equal to the 0/1 target (multilabel, ``targets`` 2-D)."""
    return float((_decisions(outputs, targets) == targets.to(torch.int64)).double().mean())


def f1_macro(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    """Unweighted mean F1 over the classes held or predicted (classification), or over the labels (multilabel)."""
    predicted = _decisions(outputs, targets)
    if targets.ndim == 1:
        classes = torch.unique(torch.cat([targets.to(torch.int64), predicted]))
        truth = targets.to(torch.int64)[:, None] == classes[None, :]
        guess = predicted[:, None] == classes[None, :]
    else:
        truth, guess = targets.to(torch.int64) == 1, predicted == 1
    tp = (truth & guess).sum(0).double()
    denominator = truth.sum(0).double() + guess.sum(0).double()
    scores = torch.where(denominator > 0, 2 * tp / denominator.clamp(min=1), torch.zeros_like(tp))
    return float(scores.mean())


def auroc(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    """Area under the ROC curve (ties count one half), per class one-vs-rest or per label, averaged over
    those with both positives and negatives; two classes: the positive class's alone."""
    if targets.ndim == 1:
        scores = torch.softmax(outputs.double(), dim=1)
        onehot = torch.nn.functional.one_hot(targets.to(torch.int64), outputs.shape[1]).bool()
        columns = [1] if outputs.shape[1] == 2 else range(outputs.shape[1])
        pairs = [(scores[:, c], onehot[:, c]) for c in columns]
    else:
        pairs = [(outputs[:, j].double(), targets[:, j] == 1) for j in range(targets.shape[1])]
    areas = [binary_auroc(s, t) for s, t in pairs if 0 < int(t.sum()) < len(t)]
    return sum(areas) / len(areas) if areas else math.nan


def binary_auroc(scores: torch.Tensor, positive: torch.Tensor) -> float:
    """The Mann-Whitney AUROC: the chance that a positive outscores a negative, ties one half (mid-ranks)."""
    order = torch.argsort(scores)
    sorted_scores = scores[order]
    ranks = torch.empty_like(scores, dtype=torch.float64)
    _, inverse, counts = torch.unique_consecutive(sorted_scores, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    ranks[order] = (ends - (counts.double() - 1) / 2)[inverse]  # the mean 1-based rank of each tie group
    n_pos = int(positive.sum())
    n_neg = len(positive) - n_pos
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def mae(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    """Mean absolute error over every target."""
    predictions, truth = _regression(outputs, targets)
    return float((predictions - truth).abs().mean())


def rmse(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    """Root of the mean squared error over every target."""
    predictions, truth = _regression(outputs, targets)
    return math.sqrt(float(((predictions - truth) ** 2).mean()))


def r2(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    """Coefficient of determination 1 - SS_res / SS_tot per target, averaged over the targets
    (scikit-learn's ``uniform_average``); a constant target scores 1 if predicted exactly, else 0."""
    predictions, truth = _regression(outputs, targets)
    residual = ((truth - predictions) ** 2).sum(0)
    total = ((truth - truth.mean(0)) ** 2).sum(0)
    exact = torch.where(residual == 0, torch.ones_like(total), torch.zeros_like(total))
    scores = torch.where(total > 0, 1 - residual / total.clamp(min=torch.finfo(total.dtype).tiny), exact)
    return float(scores.mean())


def perplexity(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    """exp of the mean next-token cross-entropy over the tokens that are not padding."""
    return math.exp(float(next_token_loss(outputs.double(), targets)))


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of position t's logits against token t + 1, padding (``IGNORE``) left out:
    ``logits`` (N, T, V), ``tokens`` (N, T)."""
    shifted = logits[:, :-1].reshape(-1, logits.shape[-1])
    return torch.nn.functional.cross_entropy(shifted, tokens[:, 1:].reshape(-1), ignore_index=IGNORE)


def _decisions(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Predicted class ids (arg-max) for class-id targets, 0/1 decisions (logit > 0) for label matrices."""
    return outputs.argmax(dim=1) if targets.ndim == 1 else (outputs > 0).to(torch.int64)


def _regression(outputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Predictions and targets as float64 (N, k): a (N, 1) output meets (N,) targets."""
    truth = targets.double().reshape(len(targets), -1)
    return outputs.double().reshape(truth.shape), truth


BUILTIN: dict[str, MetricFn] = {
    "accuracy": accuracy, "f1_macro": f1_macro, "auroc": auroc,
    "mae": mae, "rmse": rmse, "r2": r2, "perplexity": perplexity,
}
"""The built-in metrics by name."""

FITS: dict[str, tuple[str, ...]] = {
    "classification": ("accuracy", "f1_macro", "auroc"),
    "regression": ("mae", "rmse", "r2"),
    "multilabel": ("accuracy", "f1_macro", "auroc"),
    "language_model": ("perplexity",),
}
"""The built-in metrics each kind can compute."""

DEFAULTS: dict[str, tuple[str, ...]] = {
    "classification": ("accuracy",),
    "regression": ("mae", "rmse", "r2"),
    "multilabel": ("accuracy", "f1_macro"),
    "language_model": ("perplexity",),
}
"""The metrics of a kind when ``task.metrics`` is not given."""
