"""The dynamic batch controller: split a global batch B across unlike workers.

Plain logic, no I/O, no clocks: the caller measures each worker's compute time per
step (communication excluded) and passes it in; every worker of a data-parallel job
runs an identical controller on identical (all-gathered) measurements, so they agree
on the batch sizes without another message.

The rule (OmniLearn's proportional control, without its additive renormalisation):

- each measured step gives worker i a throughput sample b_i / t_i; an exponentially
  weighted moving average of them is its throughput X_i;
- the target is b_i = B · X_i / Σ_j X_j, so that every worker's step takes
  B / Σ X_j, the ideal step time;
- a dead-band keeps the plan while the predicted step times t_i = b_i / X_i are
  balanced: no change while max_i t_i / mean t < 1 + δ;
- per-worker bounds [b_min, b_max_i] are met by water-filling: a clipped worker's
  share goes to the others in proportion to their throughput;
- largest-remainder rounding makes Σ b_i = B exactly;
- adjustments happen every ``every`` measured steps (or per epoch), and the
  ``warmup`` steps after each change are not measured; a decision window whose
  throughput differs from the average by more than ``JUMP`` restarts the average
  from it, so a real change of speed is followed at once while noise is smoothed;
- an optional memory guard lowers b_max_i of a worker whose throughput fell after its
  batch grew, or that ran out of memory.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

from fedweave.config import BatchControllerConfig

log = logging.getLogger(__name__)

JUMP = 0.25
"""Relative gap between a decision window's throughput and the moving average beyond
which the average restarts from the window (a speed change rather than noise)."""



def water_fill(total: float, weights: Sequence[float], lo: Sequence[float], hi: Sequence[float]) -> list[float]:
    """Shares s_i = clip(λ · w_i, lo_i, hi_i) with Σ s_i = ``total``.

    A worker held at a bound gets the bound; the rest of ``total`` is shared by the
    others in proportion to their weights (one common λ, found exactly: Σ s_i is
    piecewise linear in λ, with breakpoints where a worker reaches a bound). Workers of
    weight 0 stay at their lower bound unless the others cannot absorb ``total``; then
    they share the rest evenly. Needs Σ lo ≤ total ≤ Σ hi.
    """
    n = len(weights)
    if not (len(lo) == len(hi) == n):
        raise ValueError("weights, lo and hi must have one value per worker")
    if any(w < 0 or not math.isfinite(w) for w in weights):
        raise ValueError(f"weights must be finite and non-negative, got {list(weights)}")
    if any(a > b for a, b in zip(lo, hi)):
        raise ValueError(f"a lower bound exceeds its upper bound: lo={list(lo)}, hi={list(hi)}")
    if not sum(lo) - 1e-9 <= total <= sum(hi) + 1e-9:
        raise ValueError(f"cannot share {total} within bounds summing to [{sum(lo)}, {sum(hi)}]")
    positive = [i for i in range(n) if weights[i] > 0]
    saturated = sum(hi[i] if weights[i] > 0 else lo[i] for i in range(n))
    if total >= saturated - 1e-9:
        if total <= saturated + 1e-9:
            return [float(hi[i] if weights[i] > 0 else lo[i]) for i in range(n)]
        # the weighted workers are full: the rest goes evenly to the others
        rest = [0.0 if weights[i] > 0 else 1.0 for i in range(n)]
        capped_lo = [hi[i] if weights[i] > 0 else lo[i] for i in range(n)]
        return water_fill(total, rest, capped_lo, hi)

    def filled(lam: float) -> float:
        return sum(min(max(lam * weights[i], lo[i]), hi[i]) if weights[i] > 0 else lo[i] for i in range(n))

    points = sorted({b / weights[i] for i in positive for b in (lo[i], hi[i])} | {0.0})
    lam, below, value = points[-1], 0.0, filled(0.0)
    for point in points:  # total < saturated = filled(points[-1]): some segment holds it
        at = filled(point)
        if at >= total:
            lam = below + (total - value) * (point - below) / (at - value) if at > value else below
            break
        below, value = point, at
    return [min(max(lam * weights[i], lo[i]), hi[i]) if weights[i] > 0 else float(lo[i]) for i in range(n)]


def apportion(
    total: int, weights: Sequence[float], lo: Sequence[int] | None = None, hi: Sequence[int | None] | None = None
) -> list[int]:
    """Integers within [lo_i, hi_i] summing to ``total``, in proportion to ``weights``.

    Water-filling for the bounds, then largest-remainder rounding (ties to the larger
    weight, then the lower index), so the result is deterministic.
    """
    n = len(weights)
    lo_ = [0] * n if lo is None else [int(v) for v in lo]
    hi_ = [total if (hi is None or hi[i] is None) else int(hi[i]) for i in range(n)]  # type: ignore[arg-type]
    hi_ = [max(h, low) for h, low in zip(hi_, lo_)]
    shares = water_fill(float(total), [float(w) for w in weights], lo_, hi_)
    out = [min(max(int(math.floor(s + 1e-9)), low), h) for s, low, h in zip(shares, lo_, hi_)]
    missing = total - sum(out)
    order = sorted(range(n), key=lambda i: (-(shares[i] - out[i]), -weights[i], i))
    while missing > 0:
        room = [i for i in order if out[i] < hi_[i]]
        if not room:
            raise ValueError(f"cannot share {total} within upper bounds {hi_}")
        for i in room[:missing]:
            out[i] += 1
        missing = total - sum(out)
    while missing < 0:
        spare = [i for i in reversed(order) if out[i] > lo_[i]]
        if not spare:
            raise ValueError(f"cannot share {total} above lower bounds {lo_}")
        for i in spare[:-missing]:
            out[i] -= 1
        missing = total - sum(out)
    return out


class BatchController:
    """Per-worker batch sizes b_i with Σ b_i = B, from measured compute times.

    Workers are named by stable ids (not ranks), so the plan survives workers leaving
    and joining. ``policy: static`` keeps equal batches and never adjusts.
    """

    def __init__(self, global_batch: int, workers: Sequence[int], settings: BatchControllerConfig | None = None):
        self.settings = settings or BatchControllerConfig()
        self.global_batch = int(global_batch)
        self.workers: list[int] = []
        self.throughput: dict[int, float] = {}  # EWMA of b_i / t_i, samples per second
        self.max_batch: dict[int, int] = {}  # per-worker caps set by the memory guard
        self.batches: dict[int, int] = {}
        self.adjustments = 0  # changes of the plan made from measurements
        self._measured = 0  # measured steps since the last decision
        self._warmup_left = 0
        self._window: dict[int, list[float]] = {}  # since the last decision: [Σ b, Σ t]
        self._grown: dict[int, tuple[int, float]] = {}  # worker -> (previous batch, throughput then)
        self.set_workers(workers)

    # ------------------------------------------------------------------ plan

    @property
    def adaptive(self) -> bool:
        return self.settings.policy == "dynamic"

    def bounds(self) -> tuple[list[int], list[int]]:
        """Per-worker [lo, hi], in the order of ``workers``, kept feasible for B."""
        s = self.settings
        lo = [s.min_batch] * len(self.workers)
        cap = self.global_batch if s.max_batch is None else s.max_batch
        hi = [min(cap, self.max_batch.get(w, cap)) for w in self.workers]
        shortfall = self.global_batch - sum(hi)
        for i in range(len(hi)):  # a guard cap never makes B impossible
            if shortfall <= 0:
                break
            raise_by = min(shortfall, cap - hi[i])
            hi[i] += raise_by
            shortfall -= raise_by
        if sum(lo) > self.global_batch or sum(hi) < self.global_batch:
            raise ValueError(
                f"global batch {self.global_batch} cannot be split over {len(self.workers)} workers "
                f"within [{s.min_batch}, {cap}] each"
            )
        return lo, hi

    def _weights(self) -> list[float]:
        """Throughput per worker; a worker not yet measured counts as the mean of the others."""
        known = [self.throughput[w] for w in self.workers if w in self.throughput]
        default = sum(known) / len(known) if known else 1.0
        return [self.throughput.get(w, default) for w in self.workers]

    def _target(self) -> dict[int, int]:
        lo, hi = self.bounds()
        weights = self._weights() if self.adaptive else [1.0] * len(self.workers)
        return dict(zip(self.workers, apportion(self.global_batch, weights, lo, hi)))

    def allocation(self, total: int) -> dict[int, int]:
        """Batch sizes for a step of ``total`` samples (the last, short step of an epoch):
        the current plan scaled down, within the upper bounds, summing to ``total``."""
        if total == self.global_batch:
            return dict(self.batches)
        _, hi = self.bounds()
        sizes = apportion(total, [float(self.batches[w]) for w in self.workers], None, hi)
        return dict(zip(self.workers, sizes))

    def imbalance(self) -> float:
        """max_i t_i / mean t of the step times the current plan is predicted to take."""
        if not self.throughput or len(self.throughput) < len(self.workers):
            return math.inf
        times = [self.batches[w] / self.throughput[w] for w in self.workers]
        mean = sum(times) / len(times)
        return max(times) / mean if mean > 0 else 1.0

    # ------------------------------------------------------------------ measurements

    def observe(self, sizes: Mapping[int, int], times: Mapping[int, float]) -> bool:
        """Record one step: worker w computed ``sizes[w]`` samples in ``times[w]`` seconds.

        Returns True when the plan changed (read the new one from ``batches``).
        """
        if not self.adaptive:
            return False
        if self._warmup_left > 0:
            self._warmup_left -= 1
            return False
        alpha = self.settings.ewma
        for w in self.workers:
            b, t = sizes.get(w, 0), times.get(w, 0.0)
            if b <= 0 or not t > 0 or not math.isfinite(t):
                continue
            sample = b / t
            old = self.throughput.get(w)
            self.throughput[w] = sample if old is None else alpha * sample + (1 - alpha) * old
            acc = self._window.setdefault(w, [0.0, 0.0])
            acc[0] += b
            acc[1] += t
        self._measured += 1
        if self.settings.cadence == "steps" and self._measured >= self.settings.every:
            return self._decide()
        return False

    def end_epoch(self) -> bool:
        """An epoch ended: with ``cadence: epoch`` this is when the plan may change."""
        if self.adaptive and self.settings.cadence == "epoch" and self._measured > 0:
            return self._decide()
        return False

    def report_oom(self, worker: int) -> bool:
        """``worker`` ran out of memory at its current batch: cap it lower and replan now."""
        b = self.batches[worker]
        previous = self._grown.get(worker, (b, 0.0))[0]
        cap = max(self.settings.min_batch, previous if previous < b else (3 * b) // 4)
        self.max_batch[worker] = min(cap, self.max_batch.get(worker, cap))
        log.warning("worker %d out of memory at batch %d: its batch is capped at %d", worker, b, cap)
        return self._change(self._target())

    def _decide(self) -> bool:
        self._measured = 0
        if self.settings.memory_guard:
            self._check_guard()
        self._follow_jumps()
        self._window = {}
        target = self._target()
        if target == self.batches:
            return False
        if self.imbalance() < 1 + self.settings.dead_band and self._within_caps():
            return False
        return self._change(target)

    def _within_caps(self) -> bool:
        _, hi = self.bounds()
        return all(self.batches[w] <= h for w, h in zip(self.workers, hi))

    def _follow_jumps(self) -> None:
        """A window whose throughput is more than ``JUMP`` away from the average is a change
        of speed, not noise: the average restarts from the window."""
        for w, (samples, seconds) in self._window.items():
            old = self.throughput.get(w)
            if old and seconds > 0 and abs(samples / seconds / old - 1) > JUMP:
                self.throughput[w] = samples / seconds

    def _check_guard(self) -> None:
        """Cap workers whose throughput fell after their batch grew."""
        for w, (previous, before) in list(self._grown.items()):
            acc = self._window.get(w)
            if acc is None or acc[1] <= 0:
                continue
            after = acc[0] / acc[1]
            del self._grown[w]
            if after < (1 - self.settings.guard_drop) * before:
                cap = max(self.settings.min_batch, previous)
                self.max_batch[w] = min(cap, self.max_batch.get(w, cap))
                self.throughput[w] = after
                log.warning(
                    "worker %d: throughput fell from %.1f to %.1f samples/s when its batch grew past %d; "
                    "capped at %d", w, before, after, previous, cap,
                )

    def _change(self, target: dict[int, int]) -> bool:
        if target == self.batches:
            return False
        self._grown = {
            w: (self.batches[w], self.throughput[w])
            for w in self.workers
            if w in self.batches and w in self.throughput and target[w] > self.batches[w]
        }
        self.batches = target
        self.adjustments += 1
        self._warmup_left = self.settings.warmup
        self._measured = 0
        self._window = {}
        log.debug("batch sizes now %s", target)
        return True

    # ------------------------------------------------------------------ world changes

    def set_workers(self, workers: Sequence[int]) -> None:
        """The set of workers changed (some left, some joined): replan over ``workers``.

        Leavers' estimates are dropped; a newcomer counts as the mean of the others
        until it is measured.
        """
        workers = sorted(int(w) for w in workers)
        if not workers:
            raise ValueError("a controller needs at least one worker")
        if len(set(workers)) != len(workers):
            raise ValueError(f"duplicate worker ids: {workers}")
        self.workers = workers
        keep = set(workers)
        self.throughput = {w: x for w, x in self.throughput.items() if w in keep}
        self.max_batch = {w: c for w, c in self.max_batch.items() if w in keep}
        self._grown = {}
        self._window = {}
        self._measured = 0
        self.batches = {}
        self.batches = self._target()
        self._warmup_left = self.settings.warmup

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        return {
            "global_batch": self.global_batch,
            "workers": list(self.workers),
            "throughput": dict(self.throughput),
            "max_batch": dict(self.max_batch),
            "batches": dict(self.batches),
            "adjustments": self.adjustments,
            "measured": self._measured,
            "warmup_left": self._warmup_left,
            "window": {w: list(v) for w, v in self._window.items()},
            "grown": {w: list(v) for w, v in self._grown.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if int(state["global_batch"]) != self.global_batch:
            raise ValueError(
                f"controller state is for global batch {state['global_batch']}, this run has {self.global_batch}"
            )
        self.workers = [int(w) for w in state["workers"]]
        self.throughput = {int(w): float(x) for w, x in state["throughput"].items()}
        self.max_batch = {int(w): int(c) for w, c in state["max_batch"].items()}
        self.batches = {int(w): int(b) for w, b in state["batches"].items()}
        self.adjustments = int(state["adjustments"])
        self._measured = int(state["measured"])
        self._warmup_left = int(state["warmup_left"])
        self._window = {int(w): [float(a), float(b)] for w, (a, b) in state["window"].items()}
        self._grown = {int(w): (int(b), float(x)) for w, (b, x) in state["grown"].items()}
