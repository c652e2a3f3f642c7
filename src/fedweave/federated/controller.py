"""The controller plans each round: who trains, with what batch size and local work.

It also observes what happened (per-client compute times) so that a
heterogeneity-aware controller can adapt the next plan. The static controller here
samples clients and gives every one the configured local work.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, Protocol

from fedweave.federated.selection import SavesState, Selection, Uniform
from fedweave.seeding import numpy_rng
from fedweave.types import Update, Work


class Controller(Protocol):
    def plan(self, rnd: int, absent: Collection[int] = ()) -> list[Work]: ...

    def work(self, client_id: int) -> Work: ...

    def observe(self, rnd: int, updates: list[Update]) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class StaticController:
    """Sample ``per_round`` of ``num_clients`` each round with ``selection`` (uniform by default;
    none of the clients the transport knows are gone, ``absent``); fixed local work."""

    def __init__(
        self,
        num_clients: int,
        per_round: int,
        *,
        batch_size: int,
        epochs: int,
        local_steps: int | None,
        seed: int,
        selection: Selection | None = None,
    ):
        self.selection = selection if selection is not None else Uniform()
        self.num_clients = num_clients
        self.per_round = per_round
        self.batch_size = batch_size
        self.epochs = epochs
        self.local_steps = local_steps
        self.seed = seed

    def plan(self, rnd: int, absent: Collection[int] = ()) -> list[Work]:
        rng = numpy_rng(self.seed, "sample", rnd)
        return [self.work(i) for i in self.selection.select(rnd, rng, self.num_clients, self.per_round, absent)]

    def work(self, client_id: int) -> Work:
        """The configured local work of one client (asynchronous aggregation asks client by client)."""
        return Work(client_id, self.batch_size, self.epochs, self.local_steps)

    def observe(self, rnd: int, updates: list[Update]) -> None:
        """The work stays as configured; the selection learns from the round."""
        self.selection.observe(rnd, updates)

    def state_dict(self) -> dict[str, Any]:
        return {"selection": self.selection.state_dict()} if isinstance(self.selection, SavesState) else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if isinstance(self.selection, SavesState) and "selection" in state:
            self.selection.load_state_dict(state["selection"])
