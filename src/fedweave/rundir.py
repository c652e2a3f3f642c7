"""The run directory: one folder per run, from its creation to its resume.

``<output_dir>/<name>-<timestamp>/`` holds ``config.yaml`` (the validated config,
written first), ``metrics.jsonl`` (one line per round or metrics window, appended as
each ends), ``checkpoint.pt`` (:mod:`fedweave.checkpoint`), ``model.pt`` (the trained
model's tensors) and the plots. Both spines, the federated runner
(:mod:`fedweave.runner`, :mod:`fedweave.launchers.process`) and the data-parallel
launcher (:mod:`fedweave.data_parallel.launch`), create, reopen and follow a run
directory through these functions.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
import yaml

from fedweave import config as config_mod
from fedweave.checkpoint import CHECKPOINT, atomic_save
from fedweave.files import atomic_write_text
from fedweave.config import Config
from fedweave.errors import CheckpointError, ConfigError
from fedweave.observe.metrics import MetricsWriter, read_metrics

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
MODEL_FILE = "model.pt"
SEALED_MODEL_FILE = "model.he.pt"
"""The global model a run kept encrypted (plugin he), as its server holds it; `fedweave decrypt` makes model.pt."""


def new_run_dir(config: Config) -> Path:
    """``<output_dir>/<name>-<timestamp>``, made unique with a suffix if it exists."""
    base = Path(config.output_dir) / f"{config.name}-{datetime.now():%Y%m%d-%H%M%S}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    path.mkdir(parents=True)
    return path


def create(config: Config, run_dir: Path | None = None) -> tuple[Path, bool]:
    """The directory of a new run (``run_dir``, else :func:`new_run_dir`) with ``config``
    saved in it, and whether it was fresh (absent or empty) before.

    A directory that already holds a run (metrics or a checkpoint) is refused rather
    than mixed with the new run's records.
    """
    run_dir = new_run_dir(config) if run_dir is None else Path(run_dir)
    if (run_dir / METRICS_FILE).exists() or (run_dir / CHECKPOINT).exists():
        raise ConfigError(
            f"run directory {str(run_dir)!r} already holds a run; continue it with "
            "`fedweave run --resume` or choose another directory"
        )
    fresh = not run_dir.exists() or not any(run_dir.iterdir())
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(config_mod.to_yaml(config), run_dir / CONFIG_FILE)
    return run_dir, fresh


def holds_run(run_dir: Path) -> bool:
    """Whether ``run_dir`` is the directory of a run begun before (its config is saved in it)."""
    return (run_dir / CONFIG_FILE).is_file()


def check_same_config(config: Config, run_dir: Path) -> None:
    """Refuse to continue the run in ``run_dir`` with a config other than the one it was begun with,
    naming the first key that differs."""
    saved = yaml.safe_load(config_mod.to_yaml(saved_config(run_dir)))
    given = yaml.safe_load(config_mod.to_yaml(config))
    if saved != given:
        key = _first_difference(saved, given)
        raise ConfigError(
            f"run directory {str(run_dir)!r} holds a run of another config (key {key!r} differs); start the "
            "server with the config it was begun with, or choose another directory"
        )


def _first_difference(a: Any, b: Any, prefix: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in [*a, *(k for k in b if k not in a)]:
            if a.get(key) != b.get(key):
                return _first_difference(a.get(key), b.get(key), f"{prefix}{key}.")
    return prefix.rstrip(".")


def saved_config(run_dir: Path) -> Config:
    """The config of the run saved in ``run_dir``; refused when it is not a run directory."""
    if not (run_dir / CONFIG_FILE).is_file():
        raise CheckpointError(f"{str(run_dir)!r} is not a run directory: it has no {CONFIG_FILE}")
    return config_mod.load(run_dir / CONFIG_FILE)


def records_until(run_dir: Path, key: str, last: int) -> list[dict[str, Any]]:
    """The metrics lines whose ``key`` (``round``, or ``step`` in data-parallel runs) is at
    most ``last``; the later ones, which a resumed run redoes, are dropped from the file."""
    metrics = MetricsWriter(run_dir / METRICS_FILE)
    metrics.truncate_after(last, key)
    return read_metrics(metrics.path)


class MetricsTail:
    """The records appended to ``metrics.jsonl`` since the last look (whole lines only)."""

    def __init__(self, path: Path, skip: int):
        self.path = path
        self.offset = 0
        self.skip = skip

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        records = [json.loads(line) for line in data[:end].splitlines() if line.strip()]
        fresh, self.skip = records[self.skip :], max(0, self.skip - len(records))
        return fresh


def save_model(params: Mapping[str, torch.Tensor], run_dir: Path) -> None:
    """The trained model's tensors in ``run_dir``."""
    atomic_save(params, run_dir / MODEL_FILE)


def save_sealed_model(tensors: Mapping[str, torch.Tensor], run_dir: Path) -> None:
    """The encrypted model's tensors (ciphertexts as uint8, layouts and integer tensors) in ``run_dir``."""
    atomic_save(tensors, run_dir / SEALED_MODEL_FILE)


def load_model(run_dir: Path) -> dict[str, torch.Tensor]:
    """The tensors :func:`save_model` wrote in ``run_dir``."""
    return torch.load(run_dir / MODEL_FILE, weights_only=True)
