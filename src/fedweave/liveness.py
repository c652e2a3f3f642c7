"""A node's liveness file: the sign of life of a node that listens on no port a probe could ask.

A gRPC client, a site member or a data-parallel worker started with ``FEDWEAVE_HEARTBEAT`` set to a
file path touches that file every interval while its loop runs (:func:`heartbeat`), and no longer
once the loop has ended. ``fedweave probe --heartbeat FILE --max-age S`` (:func:`check`) is the
orchestrator's exec probe: it fails when the file is missing or older than ``S`` seconds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from fedweave.files import atomic_write_text

log = logging.getLogger(__name__)

HEARTBEAT_ENV = "FEDWEAVE_HEARTBEAT"
"""The path of the file a node touches while it runs (none: no file)."""


def beat(path: Path) -> None:
    """Touch ``path`` (its modification time is now); create it whole where it is missing."""
    try:
        os.utime(path)
    except FileNotFoundError:
        atomic_write_text(f"{os.getpid()}\n", path)


@contextlib.contextmanager
def heartbeat(interval: float, environ: Mapping[str, str] | None = None) -> Iterator[None]:
    """While the block runs, touch the file ``FEDWEAVE_HEARTBEAT`` names at once and then every
    ``interval`` seconds, from a daemon thread that ends with the block; nothing without the variable."""
    name = (os.environ if environ is None else environ).get(HEARTBEAT_ENV)
    if not name:
        yield
        return
    path = Path(name)
    beat(path)
    stop = threading.Event()

    def beats() -> None:
        while not stop.wait(interval):
            try:
                beat(path)
            except OSError as exc:  # a full or vanished /tmp: the probe will say so
                log.warning("cannot touch the liveness file %s: %s", path, exc)

    thread = threading.Thread(target=beats, name="fedweave-liveness", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def check(path: str | Path, max_age: float) -> str | None:
    """Why the node that writes ``path`` is not alive (missing, or last touched over ``max_age`` s
    ago); None when it is."""
    try:
        age = time.time() - os.stat(path).st_mtime
    except FileNotFoundError:
        return f"{path}: missing (the node has not started its loop)"
    if age > max_age:
        return f"{path}: last touched {age:.1f} s ago, over --max-age {max_age:g}"
    return None
