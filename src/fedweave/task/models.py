"""Models, losses and evaluation of the task layer.

Every built-in model is ``head(features(x))``: ``features`` maps an input batch to a
representation of shape (N, D) and ``head`` is one ``nn.Linear`` to the logits. Algorithms
that treat the two apart (MOON's contrastive loss, FedPer's personal head) rely on it.
"""

from __future__ import annotations

import inspect
import math
import re
from dataclasses import dataclass
from typing import Any, TypeGuard
from collections.abc import Callable

import torch
from torch import nn

from fedweave.errors import TaskError
from fedweave.seeding import TORCH_GLOBAL
from fedweave.task.datasets import load_callable
from fedweave.task.metrics import BUILTIN, DEFAULTS, MetricFn, accuracy, next_token_loss

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

MODELS = ("mlp", "cnn")
"""The built-in model specs; any other ``package.module:function`` is a user factory."""



def _positive_ints(name: str, value: Any) -> tuple[int, ...]:
    """An int or a sequence of ints, each positive, as a tuple (YAML gives lists)."""
    values = (value,) if isinstance(value, int) else tuple(value)
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
        raise TaskError(f"model option {name} must be positive integers, got {value!r}")
    return values


class MLP(nn.Module):
    """Flatten, then Linear + ReLU (+ Dropout) per hidden width, then a linear head."""

    def __init__(
        self,
        input_shape: tuple[int, ...],
        num_classes: int,
        hidden: tuple[int, ...] = (128,),
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if not 0.0 <= dropout < 1.0:
            raise TaskError(f"model option dropout must lie in [0, 1), got {dropout}")
        layers: list[nn.Module] = [nn.Flatten()]
        width = math.prod(input_shape)
        for size in _positive_ints("hidden", hidden):
            layers += [nn.Linear(width, size), nn.ReLU()]
            if dropout > 0.0:
                layers.append(nn.Dropout(dropout))
            width = size
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of a batch."""
        return self.head(self.features(x))


class CNN(nn.Module):
    """Per stage conv3x3 (+ BatchNorm) + ReLU + 2x2 max-pool, then one hidden FC layer and a head.

    Padding keeps each conv size-preserving and pooling rounds up, so 8x8 digits, 28x28 MNIST and
    32x32x3 CIFAR all fit; the flattened size is measured with a dummy forward.
    """

    def __init__(
        self,
        input_shape: tuple[int, ...],
        num_classes: int,
        channels: tuple[int, ...] = (16, 32),
        hidden: int = 64,
        batch_norm: bool = False,
    ) -> None:
        super().__init__()
        if len(input_shape) != 3:
            raise TaskError(
                "model 'cnn' needs images shaped (channels, height, width), "
                f"got input_shape {tuple(input_shape)}"
            )
        if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1:
            raise TaskError(f"model option hidden must be a positive integer for 'cnn', got {hidden!r}")
        stages: list[nn.Module] = []
        in_channels = input_shape[0]
        for out_channels in _positive_ints("channels", channels):
            stages.append(nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1))
            if batch_norm:
                stages.append(nn.BatchNorm2d(out_channels))
            stages += [nn.ReLU(), nn.MaxPool2d(2, ceil_mode=True)]
            in_channels = out_channels
        conv = nn.Sequential(*stages).eval()  # eval: the dummy forward must not touch BN statistics
        with torch.no_grad():
            flat = conv(torch.zeros(1, *input_shape)).numel()
        self.features = nn.Sequential(*conv.train(), nn.Flatten(), nn.Linear(flat, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of a batch."""
        return self.head(self.features(x))


_BUILTIN: dict[str, type[nn.Module]] = {"mlp": MLP, "cnn": CNN}


def build_model(
    spec: str,
    *,
    input_shape: tuple[int, ...],
    num_classes: int,
    options: dict[str, Any] | None = None,
    seed: int | None = None,
) -> nn.Module:
    """Build the model named by ``spec`` (``mlp``, ``cnn`` or ``package.module:function``).

    With ``seed`` the initial weights are drawn from ``torch.manual_seed(seed)`` inside a forked
    RNG, so the global torch generator is left as it was.
    """
    options = dict(options or {})
    try:
        with TORCH_GLOBAL:  # its draws are never another thread's seeded ones (build.initial_params)
            if seed is None:
                return _build(spec, tuple(input_shape), num_classes, options)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                return _build(spec, tuple(input_shape), num_classes, options)
    except (MemoryError, RuntimeError) as exc:
        if not _out_of_memory(exc):
            raise
        raise TaskError(
            f"task.model {spec!r} with task.model_options {options} does not fit in memory "
            f"({_allocation(exc)}); choose a smaller model"
        ) from None


def _out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation failure (Python's, torch's on the CPU or on a GPU)."""
    text = str(exc)
    return (
        isinstance(exc, (MemoryError, torch.OutOfMemoryError))
        or "can't allocate memory" in text
        or "out of memory" in text.lower()
    )


def _allocation(exc: BaseException) -> str:
    """The size torch tried to allocate, when its message says."""
    found = re.search(r"tried to allocate (\d+) bytes", str(exc))
    return f"it tried to allocate {int(found.group(1)) / 2**30:.1f} GiB" if found else "out of memory"


def _build(spec: str, input_shape: tuple[int, ...], num_classes: int, options: dict[str, Any]) -> nn.Module:
    """Construct a built-in model or call a user factory."""
    if spec in _BUILTIN:
        cls = _BUILTIN[spec]
        fixed = ("self", "input_shape", "num_classes")
        valid = [p for p in inspect.signature(cls.__init__).parameters if p not in fixed]
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise TaskError(f"model '{spec}': unknown option {', '.join(unknown)}; valid: {', '.join(valid)}")
        return cls(input_shape, num_classes, **options)
    if ":" not in spec:
        raise TaskError(f"unknown model '{spec}'; valid: {', '.join(MODELS)} or package.module:function")
    factory = load_callable(spec, "model")
    params = inspect.signature(factory).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    shape_kwargs = {
        key: value
        for key, value in (("input_shape", input_shape), ("num_classes", num_classes))
        if takes_any or key in params
    }
    try:
        model = factory(**options, **shape_kwargs)
    except TypeError as exc:  # options the factory does not take
        raise TaskError(f"model '{spec}': {exc} (check task.model_options)") from exc
    if not isinstance(model, nn.Module):
        raise TaskError(
            f"model '{spec}': the factory must return a torch.nn.Module, got {type(model).__name__}"
        )
    return model


LOSSES: dict[str, tuple[str, ...]] = {
    "classification": ("cross_entropy", "nll", "bce"),
    "regression": ("mse", "huber"),
    "multilabel": ("bce",),
    "language_model": ("next_token",),
}
"""The built-in losses of each ``task.kind``, its default first."""


@dataclass(frozen=True, eq=False)
class TaskLoss:
    """A task's training loss (called ``loss(outputs, labels)``, mean-reduced) and the metrics
    :func:`evaluate` reports beside it."""

    kind: str
    loss: LossFn
    metrics: dict[str, MetricFn]

    def __call__(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss(outputs, labels)


def builtin_loss(loss_fn: LossFn) -> TypeGuard[TaskLoss]:
    """Whether ``loss_fn`` is a :class:`TaskLoss` of a built-in loss (not a ``package.module:function``)."""
    return isinstance(loss_fn, TaskLoss) and any(loss_fn.loss is f for f in _BUILTIN_LOSSES.values())


def make_loss(name: str | None, kind: str = "classification", metrics: list[str] | None = None) -> TaskLoss:
    """The mean-reduced loss ``name`` of a task of ``kind`` (none: the kind's default) with its ``metrics``
    (none: the kind's defaults, ``fedweave.task.metrics.DEFAULTS``); a ``package.module:function`` loss
    is called ``f(outputs, labels)``, a metric ``f(outputs, targets) -> float`` (see :func:`metric_name`).

    classification: ``cross_entropy`` (on logits), ``nll`` (on log-probabilities), ``bce`` (each logit
    against the one-hot label); regression: ``mse``, ``huber`` (delta 1); multilabel: ``bce`` (each
    logit against its 0/1 label); language_model: ``next_token`` (:func:`fedweave.task.metrics.next_token_loss`).
    """
    if kind not in LOSSES:
        raise TaskError(f"unknown task kind '{kind}'; valid: {', '.join(LOSSES)}")
    name = name or LOSSES[kind][0]
    if ":" in name:
        loss: LossFn = load_callable(name, "loss")
    elif name in LOSSES[kind]:
        loss = _BUILTIN_LOSSES[kind, name]
    else:
        raise TaskError(
            f"loss '{name}' is not a loss of kind {kind}; valid: {', '.join(LOSSES[kind])} or package.module:function"
        )
    names = list(metrics) if metrics is not None else list(DEFAULTS[kind])
    return TaskLoss(kind, loss, {metric_name(m): load_callable(m, "metric") if ":" in m else BUILTIN[m] for m in names})


def metric_name(spec: str) -> str:
    """The name a metric is recorded under: a built-in's own, a user metric's function name
    (``package.module:largest_error`` -> ``largest_error``, recorded as ``test_largest_error``)."""
    return spec.rpartition(":")[2]


def one_hot_bce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy of every logit against the one-hot encoding of ``labels``, averaged."""
    targets = nn.functional.one_hot(labels, logits.shape[-1]).to(logits.dtype)
    return nn.functional.binary_cross_entropy_with_logits(logits, targets)


def label_bce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy of every logit against its 0/1 label, averaged over examples and labels."""
    return nn.functional.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype))


def mse(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean squared error; a (N, 1) output meets (N,) targets."""
    return nn.functional.mse_loss(outputs.reshape(targets.shape), targets.to(outputs.dtype))


def huber(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Huber loss with delta 1 (squared below, absolute above); a (N, 1) output meets (N,) targets."""
    return nn.functional.huber_loss(outputs.reshape(targets.shape), targets.to(outputs.dtype))


_BUILTIN_LOSSES: dict[tuple[str, str], LossFn] = {
    ("classification", "cross_entropy"): nn.CrossEntropyLoss(),
    ("classification", "nll"): nn.NLLLoss(),
    ("classification", "bce"): one_hot_bce,
    ("regression", "mse"): mse,
    ("regression", "huber"): huber,
    ("multilabel", "bce"): label_bce,
    ("language_model", "next_token"): next_token_loss,
}


def evaluate(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn: LossFn,
    batch_size: int = 1024,
) -> dict[str, float]:
    """Mean loss and the metrics of ``model`` on (x, y), in eval mode; the training mode is restored after.

    The metrics are those of a :class:`TaskLoss` (any other ``loss_fn``: accuracy), computed on the
    outputs of every batch together. ``loss_fn`` must reduce by mean; batches are moved to the device
    of the model's parameters.
    """
    n = len(y)
    if n == 0:
        raise TaskError("evaluate: no examples to evaluate on")
    metrics = loss_fn.metrics if isinstance(loss_fn, TaskLoss) else {"accuracy": accuracy}
    device = next(model.parameters(), torch.empty(0)).device
    was_training = model.training
    model.eval()
    total_loss = 0.0
    outputs = []
    try:
        with torch.no_grad():
            for start in range(0, n, batch_size):
                xb = x[start : start + batch_size].to(device)
                yb = y[start : start + batch_size].to(device)
                out = model(xb)
                total_loss += float(loss_fn(out, yb)) * len(yb)
                outputs.append(out.cpu())
    finally:
        model.train(was_training)
    everything = torch.cat(outputs)
    return {"loss": total_loss / n, **{name: float(f(everything, y)) for name, f in metrics.items()}}
