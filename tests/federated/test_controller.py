"""Tests of fedweave.federated.controller: the static plan."""

from __future__ import annotations

from fedweave.federated.controller import StaticController
from fedweave.federated.selection import sample_clients
from fedweave.seeding import numpy_rng
from fedweave.types import Work


def controller(seed: int = 0, per_round: int = 3, local_steps: int | None = None) -> StaticController:
    return StaticController(10, per_round, batch_size=16, epochs=2, local_steps=local_steps, seed=seed)


def test_plan_gives_every_sampled_client_the_configured_work() -> None:
    plan = controller(local_steps=5).plan(1)
    ids = sample_clients(numpy_rng(0, "sample", 1), 10, 3)
    assert plan == [Work(i, batch_size=16, epochs=2, local_steps=5) for i in ids]


def test_plan_is_seeded_and_independent_of_earlier_rounds() -> None:
    fresh = controller().plan(3)
    used = controller()
    used.plan(1)
    used.plan(2)
    assert used.plan(3) == fresh  # what a resumed run relies on
    assert [controller(seed=1).plan(r) for r in range(1, 6)] != [controller().plan(r) for r in range(1, 6)]
    assert [w.client_id for w in controller(per_round=10).plan(1)] == list(range(10))


def test_static_controller_has_no_state() -> None:
    c = controller()
    c.observe(1, [])
    assert c.state_dict() == {}
    c.load_state_dict({})
    assert c.plan(2) == controller().plan(2)
