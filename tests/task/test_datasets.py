"""Tests of fedweave.task.datasets: bundled CSVs, synthetic data, torchvision adapter, user factories."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch

from fedweave.errors import ConfigError, TaskError
from fedweave.task import DATASETS, Dataset, load_dataset

DIGITS_CLASS_COUNTS = [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]


def class_counts(y: torch.Tensor, num_classes: int = 10) -> np.ndarray:
    return np.bincount(y.numpy(), minlength=num_classes)


def test_digits_shapes_values_and_classes() -> None:
    d = load_dataset("digits", seed=0)
    assert len(d.y_train) + len(d.y_test) == 1797
    assert d.input_shape == (1, 8, 8) and d.num_classes == 10
    assert d.x_train.shape[1:] == (1, 8, 8) and d.x_train.dtype == torch.float32
    assert d.y_train.dtype == torch.int64
    both = torch.cat([d.x_train, d.x_test])
    assert float(both.min()) == 0.0 and float(both.max()) == 1.0
    # pixel values are multiples of 1/16
    assert torch.allclose(both * 16, torch.round(both * 16))
    assert list(class_counts(d.y_train) + class_counts(d.y_test)) == DIGITS_CLASS_COUNTS


def test_digits_holdout_is_stratified_with_exact_size() -> None:
    d = load_dataset("digits", seed=3, test_fraction=0.2)
    assert len(d.y_test) == 359  # round(0.2 * 1797) = round(359.4)
    # quotas 0.2 * count, floors sum to 355; the 4 largest remainders (classes 7, 8, 0, 3) get one more
    assert list(class_counts(d.y_test)) == [36, 36, 35, 37, 36, 36, 36, 36, 35, 36]


def test_holdout_is_seeded_and_disjoint() -> None:
    a = load_dataset("digits", seed=1)
    b = load_dataset("digits", seed=1)
    c = load_dataset("digits", seed=2)
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    assert not torch.equal(a.x_train, c.x_train)
    # train and test together are the whole dataset: same multiset of rows, in any order
    rows = lambda d: sorted(map(tuple, torch.cat([d.x_train, d.x_test]).flatten(1).tolist()))  # noqa: E731
    assert rows(a) == rows(c)


def test_test_fraction_must_be_strictly_inside_unit_interval() -> None:
    with pytest.raises(ConfigError, match="test_fraction"):
        load_dataset("digits", seed=0, test_fraction=1.0)
    with pytest.raises(ConfigError, match="test_fraction"):
        load_dataset("synthetic", seed=0, test_fraction=0.0)


def test_mnist5k_shapes_and_balanced_holdout() -> None:
    d = load_dataset("mnist5k", seed=0, test_fraction=0.2)
    assert len(d.y_train) == 4000 and len(d.y_test) == 1000
    assert d.input_shape == (1, 28, 28) and d.x_test.shape == (1000, 1, 28, 28)
    assert d.num_classes == 10
    assert list(class_counts(d.y_test)) == [100] * 10  # 500 per class in the file
    assert float(d.x_train.min()) == 0.0 and float(d.x_train.max()) == 1.0
    # a digit's border pixels are blank, its centre is not
    mean_image = d.x_train.mean(0)[0]
    assert float(mean_image[0].sum()) == 0.0 and float(mean_image[14, 14]) > 0.3


def test_bundled_datasets_take_no_options() -> None:
    with pytest.raises(TaskError, match="takes no options, got: size"):
        load_dataset("digits", seed=0, options={"size": 3})


def test_synthetic_is_deterministic_balanced_and_learnable() -> None:
    a = load_dataset("synthetic", seed=7, options={"samples": 1000, "features": 8, "classes": 5})
    b = load_dataset("synthetic", seed=7, options={"samples": 1000, "features": 8, "classes": 5})
    c = load_dataset("synthetic", seed=8, options={"samples": 1000, "features": 8, "classes": 5})
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    assert not torch.equal(a.x_train, c.x_train)
    assert a.input_shape == (8,) and a.num_classes == 5
    assert list(class_counts(a.y_train, 5) + class_counts(a.y_test, 5)) == [200] * 5
    assert list(class_counts(a.y_test, 5)) == [40] * 5
    # nearest class mean (estimated on train) classifies the test set well
    means = torch.stack([a.x_train[a.y_train == k].mean(0) for k in range(5)])
    predicted = torch.cdist(a.x_test, means).argmin(1)
    assert float((predicted == a.y_test).float().mean()) > 0.9


def test_synthetic_defaults_and_bad_options() -> None:
    d = load_dataset("synthetic", seed=0)
    assert len(d.y_train) + len(d.y_test) == 2000 and d.input_shape == (20,) and d.num_classes == 10
    with pytest.raises(TaskError, match="unknown option noise; valid: samples, features, classes"):
        load_dataset("synthetic", seed=0, options={"noise": 1.0})
    with pytest.raises(TaskError, match="samples must be a positive integer"):
        load_dataset("synthetic", seed=0, options={"samples": -5})


def test_unknown_spec_lists_valid_names() -> None:
    with pytest.raises(TaskError) as err:
        load_dataset("cifar", seed=0)
    message = str(err.value)
    assert "'cifar'" in message and all(name in message for name in DATASETS)
    assert "\n" not in message


def test_user_factory_returning_a_tuple(user_module: Callable[[str], str]) -> None:
    name = user_module(
        """
        import numpy as np

        def make(seed, size=6):
            rng = np.random.default_rng(seed)
            x = rng.normal(size=(size, 3, 2))
            y = np.array([0, 1, 4] * (size // 3))
            return x, y, x[:2], np.array([1, 2])
        """
    )
    d = load_dataset(f"{name}:make", seed=5, options={"size": 9})
    assert d.name == f"{name}:make"
    assert d.x_train.shape == (9, 3, 2) and d.x_train.dtype == torch.float32
    assert d.y_train.dtype == torch.int64 and d.input_shape == (3, 2)
    assert d.num_classes == 5  # max label 4 + 1
    again = load_dataset(f"{name}:make", seed=5, options={"size": 9})
    assert torch.equal(d.x_train, again.x_train)


def test_user_factory_returning_a_dataset(user_module: Callable[[str], str]) -> None:
    name = user_module(
        """
        import torch
        from fedweave.task import Dataset

        def make(seed):
            x = torch.full((4, 2), float(seed))
            y = torch.tensor([0, 1, 2, 0])
            return Dataset("mine", x, y, x, y, num_classes=3, input_shape=(2,))
        """
    )
    d = load_dataset(f"{name}:make", seed=2)
    assert isinstance(d, Dataset) and d.name == "mine" and float(d.x_train[0, 0]) == 2.0


def test_bad_user_factories_give_one_line_errors(user_module: Callable[[str], str]) -> None:
    name = user_module(
        """
        def wrong_type(seed):
            return [1, 2, 3]

        def no_seed():
            return None

        not_callable = 3
        """
    )
    cases = {
        "no_such_module_xyz:make": "cannot import module 'no_such_module_xyz'",
        f"{name}:missing": f"module '{name}' has no callable 'missing'",
        f"{name}:not_callable": "has no callable 'not_callable'",
        f"{name}:wrong_type": "must return a Dataset, \\(x_train, y_train, x_test, y_test\\) or \\(x, y\\), got list",
        f"{name}:no_seed": "does not accept seed=",
    }
    for spec, pattern in cases.items():
        with pytest.raises(TaskError, match=pattern) as err:
            load_dataset(spec, seed=0)
        assert spec in str(err.value) and "\n" not in str(err.value)


def test_dataset_rejects_inconsistent_tensors() -> None:
    x = torch.zeros(3, 2)
    with pytest.raises(TaskError, match="do not match input_shape"):
        Dataset("bad", x, torch.zeros(2, dtype=torch.int64), x, torch.zeros(3, dtype=torch.int64), 2, (2,))
    with pytest.raises(TaskError, match="labels must lie in \\[0, 2\\)"):
        y = torch.tensor([0, 1, 2])
        Dataset("bad", x, y, x, y, 2, (2,))
    with pytest.raises(TaskError, match="must be float32"):
        y = torch.tensor([0, 1, 1])
        Dataset("bad", x.double(), y, x, y, 2, (2,))


def test_torchvision_missing_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchvision", None)
    with pytest.raises(TaskError) as err:
        load_dataset("torchvision:mnist", seed=0, root="/data")
    expected = "dataset 'torchvision:mnist' needs torchvision: pip install 'fedweave[torchvision]'"
    assert str(err.value) == expected


class _FakeSplit:
    """Stands in for a torchvision dataset: raises like torchvision when its folder is absent."""

    folder = ""
    shape: tuple[int, ...] = ()

    def __init__(self, root: str, train: bool, download: bool) -> None:
        assert download is False
        if not (Path(root) / self.folder).is_dir():
            raise RuntimeError("Dataset not found. You can use download=True to download it")
        n = 6 if train else 2
        self.data = np.arange(n * int(np.prod(self.shape)), dtype=np.int64).reshape(n, *self.shape) % 256
        self.targets = [i % 3 for i in range(n)]
        self.classes = ["a", "b", "c", "d"]


@pytest.fixture
def fake_torchvision(monkeypatch: pytest.MonkeyPatch) -> None:
    class MNIST(_FakeSplit):
        folder, shape = "MNIST", (28, 28)

    class CIFAR10(_FakeSplit):
        folder, shape = "cifar-10-batches-py", (32, 32, 3)

    datasets = types.ModuleType("torchvision.datasets")
    datasets.MNIST, datasets.CIFAR10 = MNIST, CIFAR10
    package = types.ModuleType("torchvision")
    package.datasets = datasets
    monkeypatch.setitem(sys.modules, "torchvision", package)
    monkeypatch.setitem(sys.modules, "torchvision.datasets", datasets)


@pytest.mark.usefixtures("fake_torchvision")
def test_torchvision_root_errors_name_root_and_layout(tmp_path: Path) -> None:
    with pytest.raises(TaskError, match="needs a local root directory holding <root>/MNIST/raw/"):
        load_dataset("torchvision:mnist", seed=0)
    with pytest.raises(TaskError, match=f"root '{tmp_path / 'nope'}' is not a directory"):
        load_dataset("torchvision:mnist", seed=0, root=str(tmp_path / "nope"))
    with pytest.raises(TaskError, match=f"files not found under root '{tmp_path}'; expected <root>/cifar-10"):
        load_dataset("torchvision:cifar10", seed=0, root=str(tmp_path))
    with pytest.raises(TaskError, match="torchvision datasets: torchvision:mnist, torchvision:cifar10"):
        load_dataset("torchvision:svhn", seed=0, root=str(tmp_path))


@pytest.mark.usefixtures("fake_torchvision")
def test_torchvision_arrays_become_nchw_unit_floats(tmp_path: Path) -> None:
    (tmp_path / "MNIST").mkdir()
    (tmp_path / "cifar-10-batches-py").mkdir()
    mnist = load_dataset("torchvision:mnist", seed=0, root=str(tmp_path))
    assert mnist.x_train.shape == (6, 1, 28, 28) and mnist.x_test.shape == (2, 1, 28, 28)
    assert mnist.input_shape == (1, 28, 28) and mnist.num_classes == 4
    assert mnist.y_train.tolist() == [0, 1, 2, 0, 1, 2]
    cifar = load_dataset("torchvision:cifar10", seed=0, root=str(tmp_path))
    assert cifar.input_shape == (3, 32, 32) and cifar.x_train.dtype == torch.float32
    # HWC -> CHW: pixel (h=0, w=0) channel 2 held raw value 2, so 2/255
    assert float(cifar.x_train[0, 2, 0, 0]) == pytest.approx(2 / 255)
    assert float(cifar.x_train[0, 0, 0, 1]) == pytest.approx(3 / 255)
    assert 0.0 <= float(cifar.x_train.min()) and float(cifar.x_train.max()) <= 1.0


def test_user_factory_without_a_test_split_gets_one_carved_by_test_fraction(user_module: Callable[[str], str]) -> None:
    name = user_module(
        """
        import numpy as np

        def make(seed):
            x = np.arange(40, dtype=np.float32).reshape(20, 2)
            return x, np.arange(20) % 2
        """
    )
    d = load_dataset(f"{name}:make", seed=3, test_fraction=0.25)
    assert (len(d.y_train), len(d.y_test)) == (15, 5)  # round(0.25 * 20)
    assert sorted(torch.cat([d.x_train, d.x_test])[:, 0].tolist()) == list(range(0, 40, 2))  # a split, no copies
    assert torch.equal(load_dataset(f"{name}:make", seed=3, test_fraction=0.25).x_test, d.x_test)  # seeded
    other = load_dataset(f"{name}:make", seed=4, test_fraction=0.25)
    assert not torch.equal(other.x_test, d.x_test)
    assert set(d.y_test.tolist()) == {0, 1}  # stratified: 10 per class -> 2 or 3 of each


def test_user_factory_labels_must_be_whole_numbers(user_module: Callable[[str], str]) -> None:
    name = user_module(
        """
        import numpy as np

        def fractional(seed):
            return np.zeros((4, 2)), np.array([0.0, 1.0, 0.5, 1.0])

        def whole(seed):
            return np.zeros((4, 2)), np.array([0.0, 1.0, 2.0, 1.0])

        def strings(seed):
            return np.zeros((4, 2)), np.array(["a", "b", "a", "b"])
        """
    )
    with pytest.raises(TaskError) as err:
        load_dataset(f"{name}:fractional", seed=0, test_fraction=0.5)
    assert "labels must be integer class ids, got 0.5" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(TaskError, match="labels must be integer class ids, got an array of <U1"):
        load_dataset(f"{name}:strings", seed=0, test_fraction=0.5)
    whole = load_dataset(f"{name}:whole", seed=0, test_fraction=0.5)
    assert sorted(torch.cat([whole.y_train, whole.y_test]).tolist()) == [0, 1, 1, 2]
