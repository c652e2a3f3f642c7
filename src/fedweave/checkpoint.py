"""Atomic checkpoints of the server state: write a temporary file, then rename.

A crash while saving leaves the previous checkpoint intact; a reader never sees a
half-written file. Files get the permissions ``open()`` would give them (the umask's).
"""

from __future__ import annotations

import io
import logging
import os
import secrets
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

import torch

from fedweave.errors import CheckpointError

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.pt"


def atomic_save(obj: Any, path: str | Path) -> None:
    """``torch.save`` to a temporary file beside ``path``, fsync, then rename over it."""
    _atomic_write(lambda f: torch.save(obj, f), Path(path))


def _atomic_write(write: Callable[[BinaryIO], Any], path: Path) -> None:
    fd, tmp = _temporary_beside(path)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(text: str, path: str | Path) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename."""
    path = Path(path)
    fd, tmp = _temporary_beside(path)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _temporary_beside(path: Path) -> tuple[int, Path]:
    """A new, hidden file in ``path``'s folder, open for writing, with the umask's permissions.

    (``tempfile.mkstemp`` would make it readable by its owner only.)
    """
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp


def save_checkpoint(run_dir: str | Path, state: dict[str, Any]) -> None:
    atomic_save(state, Path(run_dir) / CHECKPOINT)
    log.debug("checkpoint of round %d written", state["round"])


class CheckpointWriter:
    """Checkpoints written off the training path.

    ``save`` serializes the state at once (later rounds cannot change what is saved) and
    leaves writing, fsync and rename to one background thread, so the next round trains
    while the disk catches up; at most one write is in flight (the next ``save`` waits
    for it). ``close`` waits for the last one, stops the thread and raises the error of a
    failed write. A crash before a write lands leaves the previous checkpoint, from which
    a resumed run redoes the later rounds exactly.
    """

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / CHECKPOINT
        self._thread: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None

    def save(self, state: dict[str, Any]) -> None:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        self._wait()
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._pending = self._thread.submit(self._write, buffer, state["round"])

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
        _atomic_write(lambda f: f.write(buffer.getbuffer()), self.path)
        log.debug("checkpoint of round %d written", rnd)


def load_checkpoint(run_dir: str | Path) -> dict[str, Any]:
    path = Path(run_dir) / CHECKPOINT
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {str(path)!r}: nothing to resume")
    try:
        state = torch.load(path, weights_only=False)
    except Exception as exc:
        raise CheckpointError(f"checkpoint {str(path)!r} cannot be read: {exc}") from exc
    if not isinstance(state, dict) or "round" not in state:
        raise CheckpointError(f"checkpoint {str(path)!r} is not a fedweave server state")
    return state
