"""Emulated heterogeneity: unlike machines reproduced on one box.

Real heterogeneity needs none of this: the controller only sees measured times.
To reproduce a cluster of unlike nodes on one machine (config ``heterogeneity``):

- **speed factors.** Worker i has a relative speed s_i (``speeds: [1, 2, 4]``). Its
  slowdown factor is ``f_i = slowdown · max_j s_j / s_i``: the fastest configured
  worker runs at ``slowdown`` times native speed (1 = native), a worker of half its
  speed takes twice as long. After computing a step the worker sleeps until its
  compute phase has lasted ``f_i · c`` seconds, where ``c`` is the CPU time the
  process spends on a step of that batch size divided by its thread count: the time
  the same work takes with the machine to itself. ``c`` comes from the recent steps,
  not the current one alone, so that a hiccup of the host is not multiplied by f_i
  into the emulated machine: the median CPU time of each of the last ``SIZES`` batch
  sizes (over its last ``SMOOTHING`` steps), and through these points a robust
  (Theil-Sen) line c(b) = a + u·b (fixed cost plus cost per sample) when there are
  two or more.
  Measuring ``c`` in CPU time rather than wall
  time keeps the emulated speeds fixed when workers share cores: contention stretches
  wall time, not CPU time. (A worker whose wall time already exceeds ``f_i · c``, the
  fastest one under contention, does not sleep.)
- **thread limits**: ``threads: [1, 1, 2]`` sets torch's intra-op threads per worker.
- **a schedule** of speed changes: ``schedule: [{step: 200, worker: 2, speed: 1}]``
  gives worker 2 speed 1 from step 200 on (another entry later can restore it).
- **crashes**: ``crashes: [{step: 7, worker: 2}]`` SIGKILLs worker 2 at step 7 just
  before its all-reduce, as a machine failure would.
- **joins**: ``joins: [{step: 12, worker: 3}]`` has the launcher start worker 3 with
  the others; it announces itself and the running workers admit it at step 12 (see
  :mod:`fedweave.data_parallel`). Joining workers take the indices after
  ``data_parallel.workers``, and ``speeds`` / ``threads`` list them too. A worker
  beyond the configured ones (joined by hand) runs at the fastest configured speed.
"""

from __future__ import annotations

import logging
import os
import signal
import statistics
import time
from collections import deque

from fedweave.config import HeterogeneityConfig

log = logging.getLogger(__name__)

SMOOTHING = 5
"""Steps of one batch size whose median CPU time stands for that size."""

SIZES = 8
"""Recent batch sizes through whose median CPU times the cost line is fitted."""


class Emulator:
    """The emulated speed of one worker, step by step."""

    def __init__(self, config: HeterogeneityConfig, worker: int, threads: int = 1):
        self.config = config
        self.worker = worker
        self.threads = max(1, threads)
        speeds = config.speeds or [1.0] * (worker + 1)
        self.reference = max(speeds)
        self.base_speed = speeds[worker] if worker < len(speeds) else self.reference
        self.changes = sorted(
            ((c.step, c.speed) for c in config.schedule if c.worker == worker), key=lambda c: c[0]
        )
        self.crash_steps = {c.step for c in config.crashes if c.worker == worker}
        self._cpu: dict[int, deque[float]] = {}  # batch size -> recent CPU seconds of its steps

    @property
    def active(self) -> bool:
        """Whether this worker is slowed at all (some speed or schedule configured)."""
        return bool(self.config.speeds or self.changes) or self.config.slowdown != 1.0

    def speed(self, step: int) -> float:
        """The relative speed in effect at ``step``."""
        speed = self.base_speed
        for at, value in self.changes:
            if at <= step:
                speed = value
        return speed

    def factor(self, step: int) -> float:
        """How many times slower than native this worker computes at ``step`` (at least 1)."""
        return max(1.0, self.config.slowdown * self.reference / self.speed(step))

    def pad(self, step: int, batch: int, cpu_seconds: float, wall_seconds: float) -> float:
        """Sleep so that a compute phase of ``batch`` samples, which took ``cpu_seconds``
        of CPU time and ``wall_seconds``, lasts ``factor · c / threads`` with c the median
        CPU time of the recent steps of this size; returns the sleep."""
        if not self.active:
            return 0.0
        target = self.factor(step) * self.native_cost(batch, cpu_seconds) / self.threads
        extra = target - wall_seconds
        if extra <= 0:
            return 0.0
        time.sleep(extra)
        return extra

    def native_cost(self, batch: int, cpu_seconds: float) -> float:
        """Record a step's CPU time; the smoothed CPU time of a step of ``batch`` samples."""
        recent = self._cpu.pop(batch, None) or deque(maxlen=SMOOTHING)
        recent.append(cpu_seconds)
        self._cpu[batch] = recent  # the most recent size last
        while len(self._cpu) > SIZES:
            del self._cpu[next(iter(self._cpu))]
        own = statistics.median(recent)
        points = [(b, statistics.median(v)) for b, v in self._cpu.items()]
        if len(points) < 2:
            return own
        # Theil-Sen: the median of the pairwise slopes, robust to a size measured in a hiccup
        slope = statistics.median(
            (c2 - c1) / (b2 - b1) for i, (b1, c1) in enumerate(points) for b2, c2 in points[i + 1 :]
        )
        fitted = statistics.median(c - slope * b for b, c in points) + slope * batch
        return fitted if slope >= 0 and fitted > 0 else own

    def maybe_crash(self, step: int) -> None:
        """SIGKILL this process if a crash is scheduled for ``step``."""
        if step in self.crash_steps:
            log.warning("worker %d: emulated crash at step %d", self.worker, step)
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)


def worker_threads(config: HeterogeneityConfig, worker: int, default: int) -> int:
    """Torch intra-op threads of ``worker``: its ``threads`` entry, else ``default`` (0: torch's own)."""
    if worker < len(config.threads):
        return config.threads[worker]
    return default
