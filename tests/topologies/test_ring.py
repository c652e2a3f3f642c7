"""Ring gossip: a doubly stochastic mixing matrix, consensus, and accuracy close to the star on IID data."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedweave import runner
from fedweave.errors import ConfigError
from fedweave.topologies.ring import Ring, metropolis, mix, ring_neighbours, spread
from fedweave.transports.inmemory import InMemoryTransport
from fedweave.types import Instruction, Message, TaskKind, Update, UpdateKind, Work
from conftest import run_to_end, small_config

IID = [
    "clients=4",
    "rounds=6",
    "task.dataset_options={samples: 800, features: 8, classes: 4}",
]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_metropolis_ring_is_doubly_stochastic(n: int) -> None:
    w = metropolis(ring_neighbours(n))
    assert torch.allclose(w, w.T)
    assert torch.allclose(w.sum(0), torch.ones(n, dtype=torch.float64))
    assert torch.allclose(w.sum(1), torch.ones(n, dtype=torch.float64))
    assert bool((w >= 0).all())
    if n >= 3:
        assert w[0, 1] == pytest.approx(1 / 3) and w[0, 2 % n] == pytest.approx(
            1 / 3 if n == 3 else 0
        )


def test_mixing_keeps_the_mean_and_shrinks_the_spread() -> None:
    gen = torch.Generator().manual_seed(0)
    models = [
        {"w": torch.randn(5, 3, generator=gen), "steps": torch.tensor(i)}
        for i in range(4)
    ]
    mean = torch.stack([m["w"] for m in models]).mean(0)
    w = metropolis(ring_neighbours(4))
    last = spread(models)
    for _ in range(20):
        models = mix(models, w)
        now = spread(models)
        assert now < last
        last = now
    assert last < 1e-3
    assert torch.allclose(
        torch.stack([m["w"] for m in models]).mean(0), mean, atol=1e-6
    )
    assert all(int(m["steps"]) == 3 for m in models)


def test_gossip_ring_converges_to_consensus_and_matches_the_star(
    tmp_path: Path,
) -> None:
    _, star = run_to_end(tmp_path / "star", *IID)
    r = runner.prepare(small_config(*IID, "topology=ring"), tmp_path / "ring")
    ring_records = runner.execute(r)
    history = r.parts.topology.spread_history
    assert len(history) == 6
    for before, after in history:
        assert (
            after < before
        )  # every round's mixing shrinks the spread the local training opened
    assert ring_records[-1]["test_accuracy"] >= star[-1]["test_accuracy"] - 0.05


def test_ring_needs_a_weighted_mean_observer(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="ring gossip"):
        runner.prepare(
            small_config("topology=ring", "strategy=scaffold"), tmp_path / "r"
        )


def test_a_node_update_that_does_not_fit_its_model_is_rejected_before_mixing() -> None:
    """Node 1 answers without its tensor 'w' (node 2 with another shape): gossip goes on without them."""
    start = {"w": torch.zeros(2)}
    answers = {0: {"w": torch.ones(2)}, 1: {}, 2: {"w": torch.ones(5)}}

    def handle(msg: Message) -> Message:
        return Message(msg.round, msg.client_id, Update(UpdateKind.DELTA, answers[msg.client_id], 1))

    ring = Ring(InMemoryTransport(handle), 3)
    msgs = [Message(1, c, Instruction(1, TaskKind.TRAIN, Work(c, 4), start)) for c in range(3)]
    result = ring.exchange(msgs, None)
    assert result.failures == {1: "rejected: lacks tensors ['w']", 2: "rejected: tensor 'w' has shape (5,), expected (2,)"}
    assert [r.client_id for r in result.replies] == [0]
