"""How a node process ends: SIGTERM as Ctrl-C, and with the launcher that started it."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from typing import Any

log = logging.getLogger(__name__)

PARENT_ENV = "FEDWEAVE_PARENT_PID"
"""Set by the process launcher: a node ends (SIGTERM, its cleanup runs) when the process of this id does."""
KILLED_WITH_ENV = "FEDWEAVE_KILLED_WITH_PID"
"""Set by the federation service for a job's server: the node is killed (SIGKILL, nothing cleaned up, so
its run folder resumes from its last checkpoint) when the process of this id ends, kill -9 included.
The node asks for that itself, after its program started: a parent serving gRPC must not run code in
a forked child before exec (``preexec_fn``), where gRPC's fork handlers restart its threads."""


def install_signal_handlers() -> None:
    """SIGTERM ends a node as Ctrl-C does (cleanup runs); with the launcher's parent id set,
    the node also gets SIGTERM when that parent dies, so no node outlives its launcher; with the
    service's id set (:data:`KILLED_WITH_ENV`), SIGKILL when the service dies."""

    def terminate(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)
    parent = os.environ.get(PARENT_ENV)
    if parent and sys.platform.startswith("linux"):
        _signal_on_parent_death(signal.SIGTERM)
        if str(os.getppid()) != parent:
            raise KeyboardInterrupt  # the launcher is already gone
    service = os.environ.pop(KILLED_WITH_ENV, None)  # its own: a process it starts has another parent
    if service and sys.platform.startswith("linux"):
        _signal_on_parent_death(signal.SIGKILL)
        if str(os.getppid()) != service:
            os.kill(os.getpid(), signal.SIGKILL)  # the service died before the request was made


def _signal_on_parent_death(signum: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signum)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        log.debug("cannot ask to be signalled when the launcher dies")
