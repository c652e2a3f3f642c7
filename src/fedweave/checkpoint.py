"""Atomic checkpoints of the server state: written through :mod:`fedweave.files` (a temporary
file, fsync, rename), so a crash while saving leaves the previous checkpoint intact.

Checkpoints are read with ``torch.load(weights_only=True)``: tensors, plain containers
and the few fedweave types registered with :func:`checkpoint_type`; a file holding
anything else is refused rather than unpickled, so a crafted checkpoint cannot run code.

Each checkpoint records the id of its run (``run.json`` in the run directory,
:mod:`fedweave.rundir`): a checkpoint of another run, copied into a run directory, is
refused with both ids rather than resumed.
"""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import torch

from fedweave.errors import CheckpointError, first_line
from fedweave.files import atomic_write, sync_file
from fedweave.types import Update, UpdateKind

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.pt"
RUN_FILE = "run.json"
"""The run's identity, written by :func:`fedweave.rundir.create`: ``{"id": ..., "keys": ...}``."""

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


def run_id(run_dir: str | Path) -> str | None:
    """The id of the run in ``run_dir`` (None: a directory of no run, or of an older version)."""
    try:
        found = json.loads((Path(run_dir) / RUN_FILE).read_text()).get("id")
    except (OSError, ValueError, AttributeError):
        return None
    return found if isinstance(found, str) else None


def save_state(run_dir: str | Path, state: dict[str, Any]) -> None:
    """``state`` as the checkpoint of ``run_dir``, in the foreground, with the run's id."""
    atomic_save({**state, "run_id": run_id(run_dir)}, Path(run_dir) / CHECKPOINT)


class CheckpointWriter:
    """Checkpoints written off the training path.

    ``save`` serializes the state at once (later rounds cannot change what is saved) and
    leaves writing, fsync and rename to one background thread, so the next round trains
    while the disk catches up; at most one write is in flight (the next ``save`` waits
    for it). ``close`` waits for the last one, stops the thread and raises the error of a
    failed write. A crash before a write lands leaves the previous checkpoint, from which
    a resumed run redoes the later rounds exactly. ``background=False``: ``save`` returns
    once the checkpoint is on disk. ``covers``: files appended to as rounds end (the metrics
    lines), fsynced before each checkpoint is written, so that they hold every round it covers.
    """

    def __init__(self, run_dir: str | Path, background: bool = True, covers: Sequence[Path] = ()):
        self.path = Path(run_dir) / CHECKPOINT
        self.background = background
        self.covers = list(covers)
        self._thread: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None

    def save(self, state: dict[str, Any]) -> None:
        buffer = io.BytesIO()
        torch.save({**state, "run_id": run_id(self.path.parent)}, buffer)
        self._wait()
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._pending = self._thread.submit(self._write, buffer, state["round"])
        if not self.background:
            self._wait()

    def close(self) -> None:
        try:
            self._wait()
        finally:
            if self._thread is not None:
                self._thread.shutdown()
                self._thread = None

    def _wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.result()
        except Exception as exc:
            raise CheckpointError(f"checkpoint {str(self.path)!r} could not be written: {exc}") from exc

    def _write(self, buffer: io.BytesIO, rnd: int) -> None:
        for path in self.covers:
            sync_file(path)
        atomic_write(self.path, lambda f: f.write(buffer.getbuffer()))
        log.debug("checkpoint of round %d written", rnd)


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
    written_by, mine = state.get("run_id"), run_id(run_dir)
    if written_by is not None and mine is not None and written_by != mine:
        raise CheckpointError(
            f"checkpoint {str(path)!r} was written by run {written_by}, but {str(run_dir)!r} is run {mine} "
            f"(its {RUN_FILE}): a checkpoint of another run is not resumed; put this run's checkpoint back, "
            "or begin a new run"
        )
    return state


def _reason(exc: Exception) -> str:
    """One line on why ``torch.load`` failed (its own message spans a page)."""
    refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
    if refused:
        return f"it calls for {refused.group(1)}, which is not checkpoint data (refused, nothing unpickled)"
    return first_line(exc)


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
