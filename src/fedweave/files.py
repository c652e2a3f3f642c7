"""Files written whole or not at all: a temporary file beside the target, fsync, rename.

A crash while writing leaves the previous file intact; a reader never sees a
half-written file. Files get the permissions ``open()`` would give them (the umask's),
except private ones (keys, tokens, secret contexts), which end readable by their owner
only whether or not the file existed before with a looser mode.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def atomic_write(path: str | Path, write: Callable[[BinaryIO], object], private: bool = False) -> None:
    """Call ``write`` on a temporary file beside ``path``, fsync it, then rename it over ``path``.

    ``private``: the file ends with mode 0600 (owner only), also when ``path`` existed with a
    looser mode, since the rename replaces it with the temporary file.
    """
    path = Path(path)
    fd, tmp = _temporary_beside(path, 0o600 if private else 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(data: bytes, path: str | Path, private: bool = False) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename."""
    atomic_write(path, lambda f: f.write(data), private)


def atomic_write_text(text: str, path: str | Path, private: bool = False) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename."""
    atomic_write_bytes(text.encode(), path, private)


def sync_file(path: str | Path) -> None:
    """fsync ``path``: what has been written to it is on disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temporary_beside(path: Path, mode: int) -> tuple[int, Path]:
    """A new, hidden file in ``path``'s folder, open for writing, with ``mode`` less the umask.

    (``tempfile.mkstemp`` would make every file readable by its owner only.)
    """
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), tmp
