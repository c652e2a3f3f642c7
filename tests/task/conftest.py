"""Fixtures shared by the task tests."""

from __future__ import annotations

import json
import re
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], str]]:
    """Write a throwaway importable module; returns its name."""
    name = "fw_user_" + re.sub(r"\W", "_", tmp_path.name)
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(source: str) -> str:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        return name

    yield write
    sys.modules.pop(name, None)


def blobs(n: int, seed: int, features: int = 4, classes: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """``n`` samples of ``classes`` well-separated Gaussian blobs (the same means for every seed)."""
    means = np.random.default_rng(1234).normal(0.0, 3.0, size=(classes, features))
    rng = np.random.default_rng(seed)
    y = rng.permutation(np.arange(n) % classes)
    return (means[y] + rng.normal(0.0, 1.0, size=(n, features))).astype(np.float32), y.astype(np.int64)


def write_csv(path: Path, x: np.ndarray, y: np.ndarray) -> Path:
    """A CSV of columns f0.., label (one row per sample)."""
    header = ",".join([*(f"f{j}" for j in range(x.shape[1])), "label"])
    rows = [",".join([*(repr(float(v)) for v in xi), str(int(yi))]) for xi, yi in zip(x, y)]
    path.write_text("\n".join([header, *rows]) + "\n")
    return path


def write_leaf(path: Path, sizes: list[int], seed: int) -> Path:
    """LEAF JSON with one user per size, each holding that many blob samples."""
    users = [f"f_{i:05d}" for i in range(len(sizes))]
    x, y = blobs(sum(sizes), seed)
    data, start = {}, 0
    for user, size in zip(users, sizes):
        data[user] = {"x": x[start : start + size].tolist(), "y": y[start : start + size].tolist()}
        start += size
    path.write_text(json.dumps({"users": users, "num_samples": sizes, "user_data": data}))
    return path


def write_hf_sites(tmp_path: Path) -> dict[str, Any]:
    """Three sites' Hugging Face folders (``save_to_disk``; 30, 40, 50 rows, labels as names) and a
    test folder; the ``task.dataset_options`` that read them through ``{client}``."""
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    names = np.array(["ant", "bee", "cow"])
    for name, (size, seed) in {"0": (30, 0), "1": (40, 1), "2": (50, 2), "test": (60, 99)}.items():
        x, y = blobs(size, seed)
        datasets.Dataset.from_dict({"x": x.tolist(), "animal": names[y].tolist()}).save_to_disk(str(tmp_path / f"hf_{name}"))
    return {"path": str(tmp_path / "hf_{client}"), "label": "animal", "test_path": str(tmp_path / "hf_test")}


def write_image_sites(tmp_path: Path) -> dict[str, Any]:
    """Three sites' image folders of 8x8 grey PNGs in two classes (dark top or bottom half) and a
    test folder; the ``task.dataset_options`` that read them through ``{client}``."""
    image = pytest.importorskip("PIL.Image")
    rng = np.random.default_rng(0)
    for site, count in (("0", 8), ("1", 10), ("2", 12), ("test", 10)):
        for label, rows in (("dark_top", slice(0, 4)), ("dark_bottom", slice(4, 8))):
            folder = tmp_path / f"images_{site}" / label
            folder.mkdir(parents=True)
            for i in range(count):
                pixels = rng.integers(150, 256, size=(8, 8))
                pixels[rows] = rng.integers(0, 100, size=(4, 8))
                image.fromarray(pixels.astype(np.uint8)).save(folder / f"{i}.png")
    return {"path": str(tmp_path / "images_{client}"), "test_path": str(tmp_path / "images_test"),
            "classes": ["dark_top", "dark_bottom"]}


def assert_same_run(reference: list[dict[str, Any]], records: list[dict[str, Any]]) -> None:
    """Deployed records equal the simulation's, metric by metric (1e-6 relative), rounds alike."""
    assert len(records) == len(reference)
    for a, b in zip(reference, records):
        for key in ("train_loss", "test_loss", "test_accuracy", "federated_accuracy", "federated_loss"):
            assert (a.get(key) is None) == (b.get(key) is None), key
            if a.get(key) is not None:
                assert b[key] == pytest.approx(a[key], rel=1e-6), key
