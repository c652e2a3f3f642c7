"""Writes the data of examples/files-csv.yaml: three sites' CSV files and a central test set.

Each site holds Gaussian blobs of 3 classes in 4 features, in its own proportions of the
classes and of a different size (a small label and quantity skew)::

    python examples/files_csv_data.py [FOLDER]     # default: examples/data/files-csv

The files in the repository are this script's output (a test checks it).
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import numpy as np

SITES = {"site_0": (40, [0.6, 0.3, 0.1]), "site_1": (60, [0.2, 0.5, 0.3]), "site_2": (80, [0.1, 0.2, 0.7])}
TEST = ("test", (60, [1 / 3, 1 / 3, 1 / 3]))


def write(folder: Path) -> None:
    rng = np.random.default_rng(2026)
    means = rng.normal(0.0, 2.5, size=(3, 4))
    folder.mkdir(parents=True, exist_ok=True)
    for name, (rows, shares) in [*SITES.items(), TEST]:
        y = rng.choice(3, size=rows, p=shares)
        x = means[y] + rng.normal(0.0, 1.0, size=(rows, 4))
        with open(folder / f"{name}.csv", "w", newline="") as f:
            out = csv.writer(f, lineterminator="\n")
            out.writerow(["f0", "f1", "f2", "f3", "label"])
            out.writerows([*(f"{v:.4f}" for v in xi), int(yi)] for xi, yi in zip(x, y))


if __name__ == "__main__":
    write(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "data" / "files-csv"))
