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
"""Set by the process launcher: a node ends when the process of this id does."""


def install_signal_handlers() -> None:
    """SIGTERM ends a node as Ctrl-C does (cleanup runs); with the launcher's parent id set,
    the node also gets SIGTERM when that parent dies, so no node outlives its launcher."""

    def terminate(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)
    parent = os.environ.get(PARENT_ENV)
    if parent and sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            log.debug("cannot ask to be signalled when the launcher dies")
        if str(os.getppid()) != parent:
            raise KeyboardInterrupt  # the launcher is already gone
