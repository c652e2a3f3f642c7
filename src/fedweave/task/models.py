"""Models, losses and evaluation of the task layer.

Every built-in model is ``head(features(x))``: ``features`` maps an input batch to a
representation of shape (N, D) and ``head`` is one ``nn.Linear`` to the logits. Algorithms
that treat the two apart (MOON's contrastive loss, FedPer's personal head) rely on it.
"""

from __future__ import annotations

import inspect
import math
import re
from typing import Any, Callable

import torch
from torch import nn

from fedweave.errors import TaskError
from fedweave.task.datasets import load_callable

MODELS = ("mlp", "cnn")
"""The built-in model specs; any other ``package.module:function`` is a user factory."""

LOSSES = ("cross_entropy", "nll", "bce")


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


def make_loss(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The mean-reduced loss ``name``: ``cross_entropy`` (on logits), ``nll`` (on log-probabilities),
    ``bce`` (each logit against the one-hot label), or a user's ``package.module:function``
    called ``f(outputs, labels)`` that returns the batch's mean loss."""
    if name == "cross_entropy":
        return nn.CrossEntropyLoss()
    if name == "nll":
        return nn.NLLLoss()
    if name == "bce":
        return one_hot_bce
    if ":" in name:
        return load_callable(name, "loss")
    raise TaskError(f"unknown loss '{name}'; valid: {', '.join(LOSSES)} or package.module:function")


def one_hot_bce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy of every logit against the one-hot encoding of ``labels``, averaged."""
    targets = nn.functional.one_hot(labels, logits.shape[-1]).to(logits.dtype)
    return nn.functional.binary_cross_entropy_with_logits(logits, targets)


def evaluate(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    batch_size: int = 1024,
) -> dict[str, float]:
    """Mean loss and accuracy of ``model`` on (x, y), in eval mode; the training mode is restored after.

    ``loss_fn`` must reduce by mean; batches are moved to the device of the model's parameters.
    """
    n = len(y)
    if n == 0:
        raise TaskError("evaluate: no examples to evaluate on")
    device = next(model.parameters(), torch.empty(0)).device
    was_training = model.training
    model.eval()
    total_loss = 0.0
    correct = 0
    try:
        with torch.no_grad():
            for start in range(0, n, batch_size):
                xb = x[start : start + batch_size].to(device)
                yb = y[start : start + batch_size].to(device)
                logits = model(xb)
                total_loss += float(loss_fn(logits, yb)) * len(yb)
                correct += int((logits.argmax(dim=1) == yb).sum())
    finally:
        model.train(was_training)
    return {"loss": total_loss / n, "accuracy": correct / n}
