"""Atomic checkpoints of the server state: written through :mod:`fedweave.files` (a temporary
file, fsync, rename), so a crash while saving leaves the previous checkpoint intact.

Checkpoints are read with ``torch.load(weights_only=True)``: tensors, plain containers
and the few fedweave types registered with :func:`checkpoint_type`; a file holding
anything else is refused rather than unpickled, so a crafted checkpoint cannot run code.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch

from fedweave.errors import CheckpointError
from fedweave.files import atomic_write
from fedweave.files import atomic_write_text as atomic_write_text  # runner and data_parallel import it from here
from fedweave.types import Update, UpdateKind

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.pt"

T = TypeVar("T", bound=type)


def checkpoint_type(cls: T) -> T:
    """Allow instances of ``cls`` (plain data, no behaviour on load) inside checkpoints."""
    torch.serialization.add_safe_globals([cls])
    return cls


checkpoint_type(Update)
checkpoint_type(UpdateKind)


def atomic_save(obj: Any, path: str | Path) -> None:
    """``torch.save`` to a temporary file beside ``path``, fsync, then rename over it."""
    atomic_write(path, lambda f: torch.save(obj, f))


def save_checkpoint(run_dir: str | Path, state: dict[str, Any]) -> None:
    atomic_save(state, Path(run_dir) / CHECKPOINT)
    log.debug("checkpoint of round %d written", state["round"])


def load_checkpoint(run_dir: str | Path) -> dict[str, Any]:
    path = Path(run_dir) / CHECKPOINT
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {str(path)!r}: nothing to resume")
    try:
        state = torch.load(path, weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"checkpoint {str(path)!r} cannot be read: {_reason(exc)}") from None
    if not isinstance(state, dict) or "round" not in state:
        raise CheckpointError(f"checkpoint {str(path)!r} is not a fedweave server state")
    return state


def _reason(exc: Exception) -> str:
    """One line on why ``torch.load`` failed (its own message spans a page)."""
    refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
    if refused:
        return f"it calls for {refused.group(1)}, which is not checkpoint data (refused, nothing unpickled)"
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def check_params(saved: Mapping[str, Any], expected: Mapping[str, torch.Tensor], where: str) -> None:
    """A CheckpointError naming the first tensor whose name or shape in ``saved`` differs from the
    model the config builds (``expected``): a config edited since the checkpoint was written."""
    if not isinstance(saved, Mapping):
        raise CheckpointError(f"{where}: the saved parameters are not a mapping of tensors")
    for name, tensor in expected.items():
        if name not in saved:
            raise CheckpointError(f"{where}: the config's model has tensor {name!r}, the checkpoint does not")
        value = saved[name]
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"{where}: {name!r} is not a tensor in the checkpoint")
        if value.shape != tensor.shape:
            raise CheckpointError(
                f"{where}: tensor {name!r} has shape {list(value.shape)} in the checkpoint but "
                f"{list(tensor.shape)} in the config's model (was the config changed since?)"
            )
    extra = sorted(set(saved) - set(expected))
    if extra:
        raise CheckpointError(f"{where}: the checkpoint has tensor {extra[0]!r}, the config's model does not")
