"""The parts of a cohort against what the sequential loop computes, and the workers' assignment."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedweave.cohort.optim import StackedOptimizer
from fedweave.cohort.schedule import client_draws, schedule
from fedweave.cohort.workers import assign
from fedweave.training import ClientJob, LocalOptimizer, LocalSettings
from fedweave.types import Instruction, TaskKind, Work

SGD = LocalSettings(optimizer="sgd", lr=0.1, momentum=0.9, weight_decay=0.01)


def job(n: int, batch: int, epochs: int = 1, seed: int = 0) -> ClientJob:
    return ClientJob(
        client_id=0,
        instruction=Instruction(1, TaskKind.TRAIN, Work(0, batch, epochs=epochs), {}),
        model=nn.Linear(1, 1),
        x_train=torch.zeros(n, 1),
        y_train=torch.zeros(n, dtype=torch.long),
        x_test=torch.zeros(0, 1),
        y_test=torch.zeros(0, dtype=torch.long),
        loss_fn=nn.functional.cross_entropy,
        settings=SGD,
        generator=torch.Generator().manual_seed(seed),
    )


def test_a_client_draws_the_sequential_loop_s_batches() -> None:
    g = torch.Generator().manual_seed(0)
    first, second = torch.randperm(5, generator=g), torch.randperm(5, generator=g)
    draws = client_draws(job(5, 2, epochs=2), 6)  # 3 batches a pass (2, 2, 1), two passes
    expected = [first[0:2], first[2:4], [first[4], -1], second[0:2], second[2:4], [second[4], -1]]
    assert draws.tolist() == [list(map(int, row)) for row in expected]


def test_a_group_s_rows_are_offset_into_the_concatenated_data_and_padded() -> None:
    plan = schedule([job(3, 4), job(5, 4, seed=1)], [1, 2])
    assert plan.counts.tolist() == [[3, 0], [4, 1]]  # client 0: one batch of 3; client 1: 4, then 1
    assert sorted(plan.rows[0, 0, :3].tolist()) == [0, 1, 2]
    assert sorted([*plan.rows[1, 0].tolist(), plan.rows[1, 1, 0].item()]) == [3, 4, 5, 6, 7]


@pytest.mark.parametrize(
    "settings", [SGD, LocalSettings(optimizer="adam", lr=0.01, momentum=0.0, weight_decay=0.1)], ids=["sgd", "adam"]
)
def test_the_stacked_optimiser_steps_each_client_as_the_local_one_and_leaves_a_finished_one(
    settings: LocalSettings,
) -> None:
    torch.manual_seed(0)
    start = torch.randn(2, 3)
    grads = [torch.randn(2, 3) for _ in range(3)]
    stacked = {"w": start.clone()}
    opt = StackedOptimizer(settings)
    for t, g in enumerate(grads):
        active = 2 if t < 2 else 1  # client 1 does two steps, client 0 three
        opt.step(t, stacked, {"w": g[:active]}, active)
    for k, steps in ((0, 3), (1, 2)):
        p = nn.Parameter(start[k].clone())
        local = LocalOptimizer([p], settings)
        for g in grads[:steps]:
            p.grad = g[k].clone()
            local.step()
        assert torch.equal(stacked["w"][k], p.detach())  # the same operations: the same bits


def test_work_goes_to_the_least_loaded_worker() -> None:
    assert assign([5, 3, 3, 2], 2) == [0, 1, 1, 0]
    assert assign([1, 1, 1], 3) == [0, 1, 2]
    assert assign([], 2) == []


def test_groups_are_sized_to_the_memory_budget() -> None:
    from fedweave.cohort.vectorised import group_bytes, group_size

    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))
    state = (64 * 16 + 16 + 16 * 10 + 10) * 4
    # outputs per example: flatten 64, linear 16, relu 16, linear 10, the Sequential's 10; the input 64
    per_example = (64 + 16 + 16 + 10 + 10 + 64) * 4
    assert group_bytes(model, torch.zeros(1, 8, 8), 16) == 8 * state + 2 * 16 * per_example
    assert group_size(None, 10_000, 3_000) == 3  # as many as fit
    assert group_size(2, 10_000, 3_000) == 2  # simulation.cohort: K caps it
    assert group_size(None, 1_000, 3_000) == 1  # never less than one client
