"""A virtual-clock simulator of synchronous data-parallel steps, to test controllers.

Deterministic and instant (no sleeps): worker i computes b_i samples in
``b_i / speed_i`` virtual seconds (plus a fixed per-step ``overhead``), times a
lognormal factor exp(σ · N(0, 1)) when ``noise`` = σ > 0. A step ends when the
slowest worker ends. Speeds may change with the step (a function of it).

Two efficiencies are reported per step, both ``ideal / actual``:

- ``efficiency``: the allocation's, noise-free: ideal = B / Σ speed_j (+ overhead),
  actual = max_i b_i / speed_i (+ overhead). This is what a controller controls;
- ``realized``: against the noisy step time actually drawn (max of noisy times),
  which no allocation can bring to 1 when the times are noisy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from fedweave.data_parallel.controller import BatchController

Speeds = Sequence[float] | Callable[[int], Mapping[int, float]]


@dataclass
class SimStep:
    step: int
    batches: dict[int, int]
    times: dict[int, float]  # what the controller measured
    step_time: float  # max of ``times``
    ideal: float
    efficiency: float
    realized: float
    changed: bool  # the controller changed the plan after this step


def speeds_at(speeds: Speeds, step: int, workers: Sequence[int]) -> dict[int, float]:
    if callable(speeds):
        out = dict(speeds(step))
    else:
        out = dict(enumerate(float(s) for s in speeds))
    return {w: out[w] for w in workers}


def simulate(
    controller: BatchController,
    speeds: Speeds,
    steps: int,
    *,
    noise: float = 0.0,
    overhead: float = 0.0,
    seed: int = 0,
    steps_per_epoch: int | None = None,
) -> list[SimStep]:
    """Run ``steps`` virtual steps of ``controller``'s plan; one :class:`SimStep` each.

    With ``steps_per_epoch`` the controller's ``end_epoch`` is called at each epoch's end.
    """
    rng = np.random.default_rng(seed)
    trace = []
    for step in range(steps):
        workers = list(controller.workers)
        speed = speeds_at(speeds, step, workers)
        batches = dict(controller.batches)
        clean = {w: batches[w] / speed[w] + overhead for w in workers}
        factors = np.exp(noise * rng.standard_normal(len(workers))) if noise > 0 else np.ones(len(workers))
        times = {w: clean[w] * float(f) for w, f in zip(workers, factors)}
        ideal = controller.global_batch / sum(speed.values()) + overhead
        actual = max(times.values())
        changed = controller.observe(batches, times)
        if steps_per_epoch and (step + 1) % steps_per_epoch == 0:
            changed = controller.end_epoch() or changed
        trace.append(
            SimStep(
                step=step,
                batches=batches,
                times=times,
                step_time=actual,
                ideal=ideal,
                efficiency=ideal / max(clean.values()),
                realized=ideal / actual,
                changed=changed,
            )
        )
    return trace


def change_steps(trace: Sequence[SimStep]) -> list[int]:
    """The steps after which the plan changed."""
    return [s.step for s in trace if s.changed]


def mean_efficiency(trace: Sequence[SimStep], start: int = 0, stop: int | None = None) -> float:
    """Ideal time over actual time, summed over steps ``start..stop`` (allocation efficiency)."""
    window = trace[start:stop]
    return sum(s.ideal for s in window) / sum(s.ideal / s.efficiency for s in window)
