"""Uploads held to a minimum rate: a reply's stream is cut off once it runs past its deadline, so a
stalled or trickling client (slowloris) holds a server thread no longer than that."""

from __future__ import annotations

import threading
import time
from typing import Any


def upload_deadline(received: int, grace: float, min_rate: float) -> float:
    """Seconds an upload may have taken once it has ``received`` bytes: ``grace`` plus those bytes
    at ``min_rate`` bytes per second (``grpc.push_grace``, ``grpc.push_min_rate``)."""
    return grace + received / min_rate


class UploadWatchdog:
    """Cuts off a reply's upload (cancels its call) that runs past :func:`upload_deadline`: a
    stalled or trickling stream (slowloris) holds a server thread no longer than that. Re-armed
    at each frame; ``too_slow`` says why it fired (None: it did not)."""

    def __init__(self, context: Any, grace: float, min_rate: float):
        self.context = context
        self.grace = grace
        self.min_rate = min_rate
        self.start = time.monotonic()
        self.bytes = 0
        self.too_slow: str | None = None
        self._stopped = False
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._arm()

    def received(self, nbytes: int) -> None:
        """A frame of ``nbytes`` came: the deadline moves on by its bytes' time at the minimum rate."""
        with self._lock:
            self.bytes += nbytes
        self._arm()

    def _arm(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            if self._stopped or self.too_slow is not None:
                return
            left = self.start + upload_deadline(self.bytes, self.grace, self.min_rate) - time.monotonic()
            self._timer = threading.Timer(max(left, 0.0), self._fire)
            self._timer.daemon = True
            self._timer.start()

    def _fire(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self.too_slow = (
                f"upload too slow: {self.bytes} bytes in {time.monotonic() - self.start:.1f} s, below "
                f"grpc.push_min_rate {self.min_rate:g} B/s after grpc.push_grace {self.grace:g} s"
            )
        self.context.cancel()

    def stop(self) -> None:
        """The upload ended: the watchdog fires no more."""
        with self._lock:
            self._stopped = True
            if self._timer is not None:
                self._timer.cancel()
