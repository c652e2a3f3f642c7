"""What the benchmarks print of interleaved pairs of runs: the median of the per-pair ratios with
its quartiles, and the machine's load beside them (imported by the scripts in this folder)."""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence


def ratio_spread(ratios: Sequence[float]) -> tuple[float, float, float]:
    """The median of ``ratios`` and its first and third quartiles (one ratio: itself three times)."""
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return statistics.median(ratios), q1, q3


def load_average() -> str:
    """The machine's load averages over 1, 5 and 15 minutes."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())
