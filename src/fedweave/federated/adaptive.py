"""The adaptive federated controller: local work from each client's measured speed.

Plain logic, no I/O, no clocks (like :mod:`fedweave.data_parallel.controller`): the clients
measure their compute time (``Update.compute_time``) and the controller sizes the
next work so that every sampled client needs about the same time, the target round
time, whatever its speed. ``controller.kind: adaptive`` in the config selects it.

- A client's cost c_i is its compute time per training sample,
  ``compute_time / (local_steps · batch)``, kept as an exponentially weighted moving
  average per client id (a measurement more than ``JUMP`` away from the average
  restarts it: a change of speed is followed at once, noise is smoothed).
- ``adjust: steps`` gives client i ``T / (c_i · b)`` local steps of batch b =
  ``local.batch_size``; ``adjust: batch_size`` gives it a batch of ``T / (c_i · τ)``
  samples for τ = ``local.steps`` steps. Both are rounded and clipped to the
  configured bounds.
- The target T is ``target_round_time``, or else the time the configured work (local
  steps or epochs at ``local.batch_size``) takes the median client, estimated from the
  measured clients and fixed once as many clients as a round samples are measured:
  synchronously, the median compute time of the first round. (Asynchronously the first
  arrivals are the fastest clients, so the estimate grows until enough are measured.)
- A client never measured counts as the median of the measured ones; before any
  measurement every client gets the configured work.
- A client sampled in a round that the controller observed but that sent no update
  (it missed the deadline, or failed) is taken to be ``MISS_PENALTY`` times slower
  than estimated, so its work shrinks until it makes the deadline.

Clients that take unequal numbers of local steps pull the average towards the
objectives of the fast ones; FedNova (``strategy: fednova``) normalises by the steps
and is the strategy to use with ``adjust: steps``. With ``adjust: batch_size`` every
client takes the same steps and FedAvg needs no correction.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Sequence
from typing import Any

from fedweave.federated.controller import StaticController
from fedweave.data_parallel.controller import JUMP
from fedweave.config import ClientControllerConfig
from fedweave.types import Update, Work

MISS_PENALTY = 2.0
"""Factor on the estimated time per sample of a client that did not answer a round."""


class AdaptiveController:
    """Sample like ``configured`` (the static plan of the configured work); size each client's
    work to its speed."""

    def __init__(self, configured: StaticController, settings: ClientControllerConfig):
        if settings.adjust == "batch_size" and configured.local_steps is None:
            raise ValueError("adjust batch_size needs a fixed number of local steps")
        self.configured = configured
        self.settings = settings
        self.target: float | None = settings.target_round_time
        self.target_fixed = settings.target_round_time is not None
        self.cost: dict[int, float] = {}  # client -> EWMA of seconds per training sample
        self.examples: dict[int, int] = {}  # client -> training examples it reported
        self.batch: dict[int, int] = {}  # client -> batch size of its last assigned work
        self.pending: list[int] = []  # clients of the last planned round, not yet heard from
        self.observed_round = 0  # the last round observe() was called for

    # ------------------------------------------------------------------ plan

    def plan(self, rnd: int, absent: Collection[int] = ()) -> list[Work]:
        if self.observed_round == rnd - 1:
            self._penalize(self.pending)
        works = [self.work(w.client_id) for w in self.configured.plan(rnd, absent)]
        self.pending = [w.client_id for w in works]
        return works

    def work(self, client_id: int) -> Work:
        """The local work of ``client_id`` now: sized to take the target time at its speed."""
        cost = self.estimate(client_id)
        if cost is None or self.target is None:
            work = self.configured.work(client_id)
        elif self.settings.adjust == "steps":
            batch = self.configured.batch_size
            steps = self.target / (cost * min(batch, self.examples.get(client_id, batch)))
            bounded = _clip(steps, self.settings.min_steps, _cap(self.settings.max_steps))
            work = Work(client_id, batch, local_steps=bounded)
        else:
            steps = self.configured.local_steps or 0  # set: checked in __init__
            top = min(_cap(self.settings.max_batch), self.examples.get(client_id, math.inf))
            size = _clip(self.target / (cost * steps), self.settings.min_batch, top)
            work = Work(client_id, size, local_steps=steps)
        self.batch[client_id] = work.batch_size
        return work

    def estimate(self, client_id: int) -> float | None:
        """Seconds per training sample of ``client_id``: its own average, else the median of the others."""
        if client_id in self.cost:
            return self.cost[client_id]
        return statistics.median(self.cost.values()) if self.cost else None

    # ------------------------------------------------------------------ measurements

    def observe(self, rnd: int, updates: list[Update]) -> None:
        """Fold the compute times of ``updates`` into the clients' estimates (the selection sees them too)."""
        self.configured.observe(rnd, updates)
        self.observed_round = rnd
        alpha = self.settings.ewma
        for u in updates:
            cid = u.client_id
            if cid in self.pending:
                self.pending.remove(cid)
            if u.num_examples > 0:
                self.examples[cid] = u.num_examples
            batch = min(self.batch.get(cid, self.configured.batch_size), max(u.num_examples, 1))
            if u.local_steps <= 0 or not u.compute_time > 0 or not math.isfinite(u.compute_time):
                continue
            sample = u.compute_time / (u.local_steps * batch)
            old = self.cost.get(cid)
            if old is None or abs(sample / old - 1) > JUMP:
                self.cost[cid] = sample
            else:
                self.cost[cid] = alpha * sample + (1 - alpha) * old
        if not self.target_fixed and self.cost:
            self.target = statistics.median(self._configured_time(c) for c in self.cost)
            self.target_fixed = len(self.cost) >= self.configured.per_round

    def _configured_time(self, client_id: int) -> float:
        """The estimated compute time of the configured work of a measured client."""
        n = self.examples.get(client_id, self.configured.batch_size)
        batch = min(self.configured.batch_size, n)
        steps = self.configured.local_steps or self.configured.epochs * math.ceil(n / batch)
        return self.cost[client_id] * steps * batch

    def _penalize(self, clients: Sequence[int]) -> None:
        for cid in clients:
            cost = self.estimate(cid)
            if cost is not None:
                self.cost[cid] = MISS_PENALTY * cost

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "target_fixed": self.target_fixed,
            "cost": dict(self.cost),
            "examples": dict(self.examples),
            "batch": dict(self.batch),
            "pending": list(self.pending),
            "observed_round": self.observed_round,
            **self.configured.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.target = None if state["target"] is None else float(state["target"])
        self.target_fixed = bool(state["target_fixed"])
        self.cost = {int(c): float(v) for c, v in state["cost"].items()}
        self.examples = {int(c): int(v) for c, v in state["examples"].items()}
        self.batch = {int(c): int(v) for c, v in state["batch"].items()}
        self.pending = [int(c) for c in state["pending"]]
        self.observed_round = int(state["observed_round"])
        self.configured.load_state_dict(state)


def _cap(value: int | None) -> float:
    return math.inf if value is None else value


def _clip(value: float, low: int, high: float) -> int:
    return int(min(max(round(value), low), high))


def client_timings(plan: Sequence[Work], updates: Sequence[Update], waited: float | None) -> dict[str, Any]:
    """What a round's record shows of its clients' work and time.

    ``clients``: per answering client ``{id, steps, batch, compute, idle}``, idle being
    how long it waited for the round to end; ``round_time``: the slowest compute time,
    or, when a sampled client did not answer, how long the server ``waited`` for it if
    known (the round's deadline in simulation; the measured wait over a network, where a
    lost client is given up before the deadline).
    """
    batches = {w.client_id: w.batch_size for w in plan}
    times = [u.compute_time for u in updates]
    round_time = max(times, default=0.0)
    if waited is not None and len(updates) < len(plan):
        round_time = max(round_time, waited)
    clients = [
        {
            "id": u.client_id,
            "steps": u.local_steps,
            "batch": min(batches.get(u.client_id, 0), u.num_examples),
            "compute": u.compute_time,
            "idle": round_time - u.compute_time,
        }
        for u in sorted(updates, key=lambda u: u.client_id)
    ]
    return {"round_time": round_time, "clients": clients}
