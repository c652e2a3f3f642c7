"""Fixtures shared by the task tests."""

from __future__ import annotations

import json
import re
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

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
