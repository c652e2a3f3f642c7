"""A job's own deadline, from the cohort's observed times, and the back-off of clients that miss it.

A networked client may heartbeat (so it is never counted as lost) and never answer: with
one deadline for every job, ``round_timeout``, each round it is sampled waits that long
for it. Instead the server measures how long each answered job took (post to reply) and
gives the next round's jobs

    deadline = clamp(factor · q-quantile of the observed times, min_seconds, round_timeout)

(:func:`job_deadline`; ``round_timeout`` alone until a job has been answered). A client
that misses its deadline ``m`` rounds in a row is left out of the next
:func:`backoff_rounds` rounds, drawn from [2^(m−1), 2^m) by a generator seeded by the run
seed, the round and the client, at most ``most`` (binary exponential back-off); one answer
in time clears its count. Config: ``grpc.job_deadline_factor``, ``grpc.job_deadline_quantile``,
``grpc.job_deadline_min``, ``grpc.missed_deadline_backoff``.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from fedweave.seeding import numpy_rng

log = logging.getLogger(__name__)

WINDOW = 256
"""How many of the latest observed job times the deadline is computed from."""


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile of ``values`` by the nearest rank: the ⌈q·n⌉-th smallest (q in (0, 1])."""
    if not values or not 0 < q <= 1:
        raise ValueError(f"the {q}-quantile of {len(values)} values")
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q * len(ordered) - 1e-9)) - 1]


def job_deadline(
    times: Sequence[float], q: float, factor: float, min_seconds: float, ceiling: float | None
) -> float | None:
    """Seconds a job may take: ``factor`` times the ``q``-quantile of the observed ``times``, at
    least ``min_seconds``, never above ``ceiling`` (``round_timeout``; None: no ceiling). No
    observation yet: the ceiling."""
    if not times:
        return ceiling
    seconds = max(min_seconds, factor * quantile(times, q))
    return seconds if ceiling is None else min(seconds, ceiling)


def backoff_rounds(misses: int, seed: int, rnd: int, client: int, most: int) -> int:
    """Rounds a client that missed its deadline ``misses`` times in a row sits out: drawn
    uniformly from [2^(misses−1), 2^misses), seeded by ``seed``, ``rnd`` and ``client``, at most ``most``."""
    if misses < 1:
        raise ValueError(f"misses must be >= 1, got {misses}")
    low = 1 << min(misses - 1, 30)
    drawn = int(numpy_rng(seed, "deadline-backoff", rnd, client).integers(low, 2 * low))
    return min(most, drawn)


@dataclass
class Deadlines:
    """A run's job deadlines and back-off (module doc) for ``num_clients`` clients: :meth:`deadline`
    and :meth:`excluded` before a round's jobs, :meth:`observe` after them."""

    num_clients: int
    factor: float
    q: float
    min_seconds: float
    most_rounds: int
    seed: int
    times: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    misses: dict[int, int] = field(default_factory=dict)  # client -> deadlines missed in a row
    until: dict[int, int] = field(default_factory=dict)  # client -> the first round it may be sampled again

    def deadline(self, ceiling: float | None) -> float | None:
        """The next jobs' deadline in seconds (``ceiling``: round_timeout)."""
        return job_deadline(list(self.times), self.q, self.factor, self.min_seconds, ceiling)

    def excluded(self, rnd: int) -> frozenset[int]:
        """The clients backing off in round ``rnd``: none of them is sampled."""
        return frozenset(cid for cid, first in self.until.items() if rnd < first)

    def observe(self, rnd: int, elapsed: Mapping[int, float], missed: Collection[int]) -> None:
        """Round ``rnd``'s jobs: those answered, with their seconds (``elapsed``), and the clients
        that ``missed`` their deadline, each then backing off (logged)."""
        for cid, seconds in sorted(elapsed.items()):
            self.times.append(seconds)
            self.misses.pop(cid, None)
            self.until.pop(cid, None)
        for cid in sorted(missed):
            count = self.misses[cid] = self.misses.get(cid, 0) + 1
            rounds = backoff_rounds(count, self.seed, rnd, cid, self.most_rounds)
            if rounds:
                self.until[cid] = rnd + 1 + rounds
                log.warning("round %d: client %d missed its deadline (%d in a row): not sampled for %d round%s",
                            rnd, cid, count, rounds, "s" * (rounds != 1))
