"""Client selection: who trains in a round (``selection.name``).

A :class:`Selection` chooses ``count`` of ``num_clients`` with the round's seeded generator
(none of those ``absent``) and observes the round's accepted updates. What it may learn from
an update is what the server already holds: the update counts for its sender's authenticated
id (never an id written in it), with the training loss, example count (bounded by the server's
rules) and compute time its client reported. A selection that keeps state between rounds
(:class:`SavesState`) is checkpointed with the controller, so a resumed run selects as the
uninterrupted one.

- ``uniform``: ``count`` distinct clients uniformly at random (:func:`sample_clients`), the draws
  fedweave always made.
- ``power_of_choice`` (Cho, Wang, Joshi 2020, "Client selection in federated learning:
  convergence analysis and power-of-choice selection strategies"): draw ``d`` candidates
  uniformly, keep the ``count`` with the highest local loss. The losses are those the clients
  last reported in training (the paper's communication-free variant, π_rpow-d); a client never
  heard from ranks above all (its loss is unknown: it is explored first).
- ``oort`` (Lai et al., OSDI'21, "Oort: efficient federated learning via guided participant
  selection", Algorithm 1): each explored client's utility is its statistical utility
  ``|B_i| · loss_i`` plus the temporal uncertainty ``sqrt(0.1 · log R / L_i)`` (``L_i``: the last
  round it took part in), times the system penalty ``(T / t_i)^α`` where its duration t_i
  exceeds the preferred round duration T. A share ε of the slots explores clients never heard
  from (uniformly: the server knows nothing of their speed); the rest exploit: the clients
  whose utility reaches ``cutoff`` times the utility ranked at the number of exploiting slots,
  sampled with probability proportional to utility. ε starts at ``exploration`` and decays by
  ``exploration_decay`` a round to ``min_exploration``. T is the ``percentile`` of the explored
  clients' durations; the pacer raises that percentile by ``pacer_step`` when the exploited
  utility of the last ``pacer_window`` rounds fell below the window before's. The clients report
  their mean training loss; it stands for the root mean square of their samples' losses that the
  paper's ``|B_i| sqrt(Σ loss² / |B_i|)`` asks for.

A user's selection is ``package.module:Class``, constructed with the ``selection`` settings.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from fedweave.types import Update


class Selection(Protocol):
    def select(self, rnd: int, rng: np.random.Generator, num_clients: int, count: int,
               absent: Collection[int] = ()) -> list[int]:
        """``count`` distinct client ids (fewer if fewer are present), none of them ``absent``, in increasing order."""

    def observe(self, rnd: int, updates: Sequence[Update]) -> None:
        """The accepted updates of round ``rnd``, each counted for its sender's authenticated id."""


@runtime_checkable
class SavesState(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def sample_clients(rng: np.random.Generator, num_clients: int, count: int, absent: Collection[int] = ()) -> list[int]:
    """``count`` distinct client ids out of ``num_clients``, none of them ``absent``, in increasing order.

    O(count + |absent|) for a large population: numpy's ``choice`` without replacement draws a
    few ids of many with Floyd's algorithm (a set of the chosen), never a permutation of all.
    With clients ``absent`` (known gone) it draws |absent| more and keeps the first ``count``
    present ones in the order drawn (the draw is a uniformly random sequence, so they are a
    uniform sample of the present clients), or every present one if fewer are left. Without,
    the draw is the plain one, so a run where nobody is gone samples exactly as before."""
    return sorted(_drawn(rng, num_clients, count, absent))


def _drawn(rng: np.random.Generator, num_clients: int, count: int, absent: Collection[int] = ()) -> list[int]:
    """:func:`sample_clients`' ids in the order drawn."""
    if not 1 <= count <= num_clients:
        raise ValueError(f"cannot sample {count} of {num_clients} clients")
    gone = {i for i in absent if 0 <= i < num_clients}
    size = min(count + len(gone), num_clients)
    if size == num_clients:
        drawn = range(num_clients) if not gone else rng.permutation(num_clients)
    else:
        drawn = rng.choice(num_clients, size=size, replace=False)
    present = [int(i) for i in drawn if int(i) not in gone]
    return present[:count]


class Uniform:
    """Today's draw: ``count`` clients uniformly at random."""

    def __init__(self, settings: Any = None):
        self.settings = settings

    def select(self, rnd: int, rng: np.random.Generator, num_clients: int, count: int,
               absent: Collection[int] = ()) -> list[int]:
        return sample_clients(rng, num_clients, count, absent)

    def observe(self, rnd: int, updates: Sequence[Update]) -> None:
        """Uniform sampling learns nothing."""


def reported_loss(update: Update) -> float | None:
    """The training loss an update reports, if it is a finite number."""
    loss = update.metrics.get("train_loss")
    return float(loss) if isinstance(loss, (int, float)) and math.isfinite(loss) else None


class PowerOfChoice:
    """Draw ``candidates`` (d; default twice ``count``; at least ``count``), keep the ``count`` with
    the highest last reported loss; unknown losses first, ties in the order drawn."""

    def __init__(self, settings: Any):
        self.candidates: int | None = settings.candidates
        self.loss: dict[int, float] = {}

    def select(self, rnd: int, rng: np.random.Generator, num_clients: int, count: int,
               absent: Collection[int] = ()) -> list[int]:
        d = min(max(self.candidates or 2 * count, count), num_clients)
        drawn = _drawn(rng, num_clients, d, absent)
        ranked = sorted(drawn, key=lambda c: -self.loss.get(c, math.inf))  # stable: ties as drawn
        return sorted(ranked[:count])

    def observe(self, rnd: int, updates: Sequence[Update]) -> None:
        for u in updates:
            if (loss := reported_loss(u)) is not None:
                self.loss[u.client_id] = loss

    def state_dict(self) -> dict[str, Any]:
        return {"loss": dict(self.loss)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loss = {int(c): float(v) for c, v in state["loss"].items()}


def oort_utility(statistical: float, last_round: int, rnd: int, duration: float, preferred: float | None,
                 penalty: float) -> float:
    """Oort's utility of a client in round ``rnd``: ``statistical + sqrt(0.1 log rnd / last_round)``,
    times ``(preferred / duration)^penalty`` when the client is slower than the preferred duration."""
    utility = statistical + math.sqrt(0.1 * math.log(rnd) / last_round)
    if preferred is not None and duration > preferred > 0:
        utility *= (preferred / duration) ** penalty
    return utility


def percentile(values: Sequence[float], share: float) -> float:
    """The value ranked at ``share`` percent of the sorted ``values`` (Oort's preferred duration)."""
    ordered = sorted(values)
    return ordered[min(int(len(ordered) * share / 100), len(ordered) - 1)]


class Oort:
    """Guided participant selection (Lai et al., OSDI'21); the module's doc says how."""

    def __init__(self, settings: Any):
        self.s = settings
        self.statistical: dict[int, float] = {}  # client -> |B_i| · loss_i
        self.duration: dict[int, float] = {}  # client -> its last compute time
        self.last: dict[int, int] = {}  # client -> the last round it took part in
        self.exploration = settings.exploration
        self.percentile = settings.percentile
        self.history: list[float] = []  # per round, the summed statistical utility of the exploited clients
        self.exploited: set[int] = set()

    def preferred(self) -> float | None:
        return percentile(list(self.duration.values()), self.percentile) if self.duration else None

    def utilities(self, rnd: int, clients: Collection[int]) -> dict[int, float]:
        """The utility of each explored one of ``clients`` in round ``rnd``."""
        t = self.preferred()
        return {c: oort_utility(self.statistical[c], self.last[c], rnd, self.duration.get(c, 0.0), t,
                                self.s.penalty)
                for c in clients if c in self.statistical}

    def select(self, rnd: int, rng: np.random.Generator, num_clients: int, count: int,
               absent: Collection[int] = ()) -> list[int]:
        gone = set(absent)
        present = [c for c in range(num_clients) if c not in gone]
        count = min(count, len(present))
        utility = self.utilities(rnd, present)
        unexplored = [c for c in present if c not in utility]
        explore = min(len(unexplored), max(count - len(utility), round(self.exploration * count)))
        exploit = count - explore
        chosen = self._exploit(rng, utility, exploit)
        self.exploited = set(chosen)
        if explore:
            chosen += [unexplored[int(i)] for i in rng.choice(len(unexplored), size=explore, replace=False)]
        self.exploration = max(self.exploration * self.s.exploration_decay, self.s.min_exploration)
        return sorted(chosen)

    def _exploit(self, rng: np.random.Generator, utility: dict[int, float], slots: int) -> list[int]:
        """``slots`` clients of those whose utility reaches ``cutoff`` x the ``slots``-th highest,
        sampled without replacement with probability proportional to utility."""
        if slots <= 0:
            return []
        ranked = sorted(utility, key=lambda c: (-utility[c], c))
        bar = self.s.cutoff * utility[ranked[slots - 1]]
        admitted = [c for c in ranked if utility[c] >= bar]
        if len(admitted) == slots:
            return admitted
        weights = np.array([utility[c] for c in admitted], dtype=float)
        picked = rng.choice(len(admitted), size=slots, replace=False, p=weights / weights.sum())
        return [admitted[int(i)] for i in picked]

    def observe(self, rnd: int, updates: Sequence[Update]) -> None:
        for u in updates:
            loss = reported_loss(u)
            if loss is None:
                continue
            self.statistical[u.client_id] = u.num_examples * loss
            self.last[u.client_id] = rnd
            if u.compute_time > 0 and math.isfinite(u.compute_time):
                self.duration[u.client_id] = u.compute_time
        self.history.append(sum(self.statistical.get(c, 0.0) for c in self.exploited))
        self._pace()

    def _pace(self) -> None:
        """Relax T when the exploited utility of the last window fell below the window before's."""
        w = self.s.pacer_window
        if len(self.history) >= 2 * w and len(self.history) % w == 0:
            if sum(self.history[-2 * w:-w]) > sum(self.history[-w:]):
                self.percentile = min(100.0, self.percentile + self.s.pacer_step)

    def state_dict(self) -> dict[str, Any]:
        return {"statistical": dict(self.statistical), "duration": dict(self.duration), "last": dict(self.last),
                "exploration": self.exploration, "percentile": self.percentile, "history": list(self.history),
                "exploited": sorted(self.exploited)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.statistical = {int(c): float(v) for c, v in state["statistical"].items()}
        self.duration = {int(c): float(v) for c, v in state["duration"].items()}
        self.last = {int(c): int(v) for c, v in state["last"].items()}
        self.exploration = float(state["exploration"])
        self.percentile = float(state["percentile"])
        self.history = [float(v) for v in state["history"]]
        self.exploited = {int(c) for c in state["exploited"]}


BUILTIN = {"uniform": Uniform, "power_of_choice": PowerOfChoice, "oort": Oort}


def selection_class(name: str, key: str = "selection.name") -> type:
    """The class ``name`` stands for (built-in, or ``package.module:Class`` with ``select`` and ``observe``)."""
    from fedweave.errors import ConfigError
    from fedweave.registry import import_object

    if name in BUILTIN:
        return BUILTIN[name]
    if ":" not in name:
        raise ConfigError(f"config key '{key}': unknown selection {name!r}; built-in: {', '.join(BUILTIN)}, "
                          "or give 'package.module:Class'")
    cls = import_object(name, key)
    missing = [m for m in ("select", "observe") if not callable(getattr(cls, m, None))]
    if not isinstance(cls, type) or missing:
        raise ConfigError(f"config key '{key}': {name!r} is no selection class (it needs {', '.join(missing) or 'to be a class'})")
    return cls


def build_selection(settings: Any) -> Selection:
    """The selection ``settings`` (the config's ``selection`` section) names."""
    return selection_class(settings.name)(settings)
