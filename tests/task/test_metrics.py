"""Tests of fedweave.task.metrics and the kinds' losses: each against values computed by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from sklearn.metrics import f1_score, r2_score, roc_auc_score

from fedweave.errors import TaskError
from fedweave.task import evaluate, make_loss
from fedweave.task.metrics import IGNORE, accuracy, auroc, binary_auroc, f1_macro, mae, perplexity, r2, rmse


def test_accuracy_of_classes_and_of_label_decisions() -> None:
    logits = torch.tensor([[2.0, 1.0], [0.0, 3.0], [1.0, 0.0], [0.0, 1.0]])
    assert accuracy(logits, torch.tensor([0, 1, 1, 1])) == 0.75  # predictions 0, 1, 0, 1
    # decisions (logit > 0): [[1, 0], [0, 1], [1, 1]] against [[1, 0], [1, 1], [0, 1]]: 4 of 6 right
    labels = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0]])
    assert accuracy(torch.tensor([[1.0, -1.0], [-1.0, 1.0], [1.0, 1.0]]), labels) == pytest.approx(4 / 6)


def test_f1_macro_of_classes() -> None:
    # truth 0 0 1 1 2, predictions 0 1 1 1 0: class 0 tp 1 of 2 held, 2 predicted: F1 0.5;
    # class 1 tp 2, 2 held, 3 predicted: 0.8; class 2 held once, never predicted: 0
    y = torch.tensor([0, 0, 1, 1, 2])
    logits = torch.nn.functional.one_hot(torch.tensor([0, 1, 1, 1, 0]), 3).float()
    assert f1_macro(logits, y) == pytest.approx((0.5 + 0.8 + 0.0) / 3)
    assert f1_macro(logits, y) == pytest.approx(f1_score([0, 0, 1, 1, 2], [0, 1, 1, 1, 0], average="macro"))


def test_f1_macro_of_labels() -> None:
    # label 0: truth 1 1 0, decisions 1 0 1: tp 1, F1 2 / 4; label 1: truth 0 1 1, decisions 0 1 1: F1 1
    labels = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0]])
    logits = torch.tensor([[1.0, -1.0], [-1.0, 1.0], [1.0, 1.0]])
    assert f1_macro(logits, labels) == pytest.approx(0.75)
    # a label nobody holds nor is predicted to hold has no F1: 0 (scikit-learn's zero_division=0)
    silent = torch.cat([labels, torch.zeros(3, 1)], dim=1), torch.cat([logits, -torch.ones(3, 1)], dim=1)
    assert f1_macro(silent[1], silent[0]) == pytest.approx(0.5)


def test_auroc_counts_ties_one_half() -> None:
    # positives score 0.4 and 0.8, negatives 0.1 and 0.4: pairs 1 + 0.5 (the tie) + 1 + 1 of 4
    positive = torch.tensor([False, False, True, True])
    assert binary_auroc(torch.tensor([0.1, 0.4, 0.4, 0.8]), positive) == 0.875
    # two classes: the softmax's positive column, monotone in the logit gap (-2, 0, 0, 1)
    logits = torch.tensor([[0.0, -2.0], [0.0, 0.0], [0.0, 0.0], [0.0, 1.0]])
    assert auroc(logits, torch.tensor([0, 0, 1, 1])) == 0.875
    assert roc_auc_score([0, 0, 1, 1], [0.1, 0.4, 0.4, 0.8]) == 0.875


def test_auroc_averages_classes_and_labels_that_have_both_outcomes() -> None:
    # label 0: positives 3, 1 vs negative 2: 1 of 2 pairs won; label 1: every sample positive, left out
    labels = torch.tensor([[1.0, 1.0], [0.0, 1.0], [1.0, 1.0]])
    scores = torch.tensor([[3.0, 0.0], [2.0, 0.0], [1.0, 0.0]])
    assert auroc(scores, labels) == 0.5
    assert math.isnan(auroc(scores, torch.ones(3, 2)))
    # three classes one-vs-rest: the mean of the three binary areas
    logits = torch.tensor([[3.0, 0.0, 0.0], [0.0, 2.0, 1.0], [0.0, 1.0, 2.0], [1.0, 0.0, 0.5]])
    y = torch.tensor([0, 1, 2, 0])
    probabilities = torch.softmax(logits.double(), dim=1).numpy()
    expected = roc_auc_score(y.numpy(), probabilities, multi_class="ovr", average="macro")
    assert auroc(logits, y) == pytest.approx(expected)


def test_regression_errors() -> None:
    # errors 0, 1, -1, 0: mae 0.5, rmse sqrt(0.5); SS_res 2, SS_tot (mean 2.5) 5: r2 1 - 2 / 5
    truth, predicted = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([[1.0], [3.0], [2.0], [4.0]])
    assert mae(predicted, truth) == 0.5
    assert rmse(predicted, truth) == pytest.approx(math.sqrt(0.5))
    assert r2(predicted, truth) == pytest.approx(0.6)


def test_r2_averages_targets_as_sklearn_does() -> None:
    truth = torch.tensor([[1.0, 0.0], [2.0, 1.0], [3.0, 0.0], [4.0, 1.0]])
    predicted = torch.tensor([[1.0, 0.5], [3.0, 0.5], [2.0, 0.5], [4.0, 0.5]])
    # target 0: 0.6 (above); target 1: SS_res 4 * 0.25 = SS_tot: 0
    assert r2(predicted, truth) == pytest.approx(0.3)
    rng = np.random.default_rng(0)
    y, p = rng.normal(size=(30, 3)), rng.normal(size=(30, 3))
    assert r2(torch.from_numpy(p), torch.from_numpy(y)) == pytest.approx(r2_score(y, p))


def test_perplexity_of_the_next_token_leaves_padding_out() -> None:
    # position 0 gives token 1 probability e^ln3 / (1 + 3) = 3/4; position 1 predicts padding: left out
    logits = torch.tensor([[[0.0, math.log(3.0)], [5.0, -5.0], [0.0, 0.0]]])
    tokens = torch.tensor([[0, 1, IGNORE]])
    assert perplexity(logits, tokens) == pytest.approx(4 / 3)
    assert perplexity(torch.zeros(2, 4, 5), torch.zeros(2, 4, dtype=torch.int64)) == pytest.approx(5.0)
    assert float(make_loss(None, "language_model")(logits, tokens)) == pytest.approx(math.log(4 / 3))


def test_regression_and_multilabel_losses() -> None:
    outputs, targets = torch.tensor([[1.0], [3.0], [0.0]]), torch.tensor([1.0, 1.0, 2.5])
    assert float(make_loss(None, "regression")(outputs, targets)) == pytest.approx((0 + 4 + 6.25) / 3)
    # huber, delta 1: 0 where equal, |e| - 1/2 beyond 1 (2 - 0.5, 2.5 - 0.5)
    assert float(make_loss("huber", "regression")(outputs, targets)) == pytest.approx((0 + 1.5 + 2.0) / 3)
    logits, labels = torch.tensor([[0.0, math.log(3.0)]]), torch.tensor([[1.0, 1.0]])
    # sigmoid 1/2 and 3/4 against 1: -(log 1/2 + log 3/4) / 2
    bce = -(math.log(0.5) + math.log(0.75)) / 2
    assert float(make_loss(None, "multilabel")(logits, labels)) == pytest.approx(bce)
    with pytest.raises(TaskError, match="loss 'cross_entropy' is not a loss of kind regression; valid: mse, huber"):
        make_loss("cross_entropy", "regression")


def test_evaluate_reports_the_kinds_metrics_on_every_batch_together() -> None:
    model = torch.nn.Linear(1, 1)
    with torch.no_grad():
        model.weight.fill_(1.0)
        model.bias.zero_()
    x, y = torch.tensor([[1.0], [3.0], [2.0], [4.0]]), torch.tensor([1.0, 2.0, 3.0, 4.0])
    result = evaluate(model, x, y, make_loss(None, "regression", ["r2", "mae"]), batch_size=3)
    assert result == pytest.approx({"loss": 0.5, "r2": 0.6, "mae": 0.5})
    custom = make_loss("mse", "regression", [f"{__name__}:largest_error"])
    assert evaluate(model, x, y, custom)["largest_error"] == 1.0


def largest_error(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    """A user metric: the largest absolute error."""
    return float((outputs.reshape(targets.shape) - targets).abs().max())
