"""The parts of a cohort against what the sequential loop computes, and the workers' assignment."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from fedweave.cohort.optim import StackedOptimizer
from fedweave.cohort.schedule import client_draws, schedule
from fedweave.cohort.trainer import Pending, batch_width, groups
from fedweave.cohort.workers import assign
from fedweave.training import ClientJob, LocalOptimizer, LocalSettings, LocalStep
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


@pytest.mark.parametrize("seed", range(20))
def test_a_group_s_schedule_lays_out_each_client_s_own_draws(seed: int) -> None:
    """The vectorised layout of :func:`schedule` against each client's :func:`client_draws`, for
    clients of unequal sizes, batch sizes, epochs and step counts (some a part of a pass)."""
    from fedweave.cohort.vectorised import steps_of

    rng = torch.Generator().manual_seed(seed)
    specs = [(int(torch.randint(1, 40, (1,), generator=rng)), int(torch.randint(1, 12, (1,), generator=rng)),
              int(torch.randint(1, 4, (1,), generator=rng)), int(torch.randint(0, 25, (1,), generator=rng)))
             for _ in range(int(torch.randint(1, 8, (1,), generator=rng)))]

    def jobs() -> list[ClientJob]:
        out = []
        for k, (n, batch, epochs, steps) in enumerate(specs):
            j = job(n, batch, epochs, seed=100 * seed + k)
            if steps:  # local steps, not epochs
                j.instruction = Instruction(1, TaskKind.TRAIN, Work(0, batch, epochs=epochs, local_steps=steps), {})
            out.append(j)
        return out

    mine, theirs = jobs(), jobs()
    steps = [steps_of(j) for j in mine]
    plan = schedule(mine, steps)
    offset = 0
    for k, (j, s) in enumerate(zip(theirs, steps)):
        table = client_draws(j, s)
        real = (table >= 0).sum(1)
        assert plan.counts[k, :s].tolist() == real.tolist() and not plan.counts[k, s:].any()
        for t in range(s):
            assert plan.rows[k, t, : real[t]].tolist() == (table[t, : real[t]] + offset).tolist()
        offset += j.x_train.shape[0]
    assert all(torch.equal(a.generator.get_state(), b.generator.get_state()) for a, b in zip(mine, theirs))


def test_momentum_added_into_its_buffers_steps_as_the_optimiser_does() -> None:
    """SGD momentum through :meth:`StackedOptimizer.momentum_buffers` (the caller adds each gradient
    into its buffer) against the optimiser adding it: the same steps, to float rounding."""
    from fedweave.cohort.optim import Workspace

    torch.manual_seed(0)
    settings = LocalSettings(optimizer="sgd", lr=0.1, momentum=0.9, weight_decay=0.0)
    start = torch.randn(3, 4, 5)
    grads = [torch.randn(3, 4, 5) for _ in range(4)]
    plain, fused = {"w": start.clone()}, {"w": start.clone()}
    a, b = StackedOptimizer(settings), StackedOptimizer(settings, Workspace())
    assert StackedOptimizer(SGD).momentum_buffers(1, plain, 3) is None  # weight decay needs the gradient alone
    for t, g in enumerate(grads):
        active = 3 if t < 2 else 2
        a.step(t, plain, {"w": g[:active]}, active)
        into = b.momentum_buffers(t, fused, active)
        assert into is not None and (into[1] is None) == (t == 0)
        buffer = into[0]["w"]
        if into[1] is None:
            buffer.copy_(g[:active])
        else:
            buffer.mul_(into[1]).add_(g[:active])
        b.step(t, fused, into[0], active, accumulated=True)
    assert torch.allclose(plain["w"], fused["w"], rtol=0, atol=1e-6)


def test_a_workspace_gives_the_first_rows_of_what_it_keeps() -> None:
    from fedweave.cohort.optim import Workspace

    ws = Workspace()
    big = ws.take("x", (4, 3), torch.float32, torch.device("cpu"))
    small = ws.take("x", (2, 3), torch.float32, torch.device("cpu"))
    assert small.data_ptr() == big.data_ptr() and small.shape == (2, 3) and small.is_contiguous()
    assert ws.take("x", (5, 3), torch.float32, torch.device("cpu")).shape == (5, 3)  # more rows: a new one
    assert ws.take("x", (2, 4), torch.float32, torch.device("cpu")).shape == (2, 4)  # another shape: a new one


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


def test_a_batch_is_padded_to_the_run_s_batch_size_doubled_or_halved() -> None:
    widths = {b: batch_width(b, base=16, largest=1000) for b in (1, 3, 5, 8, 9, 16, 17, 32, 33, 100)}
    assert widths == {1: 8, 3: 8, 5: 8, 8: 8, 9: 16, 16: 16, 17: 32, 32: 32, 33: 64, 100: 128}  # multiples of 8
    assert [batch_width(b, base=48, largest=1000) for b in (10, 13, 20, 25, 49)] == [16, 24, 24, 48, 96]
    assert batch_width(64, base=16, largest=40) == 40  # no client has more rows: not padded beyond them
    assert batch_width(64, base=16, largest=21) == 24  # but to a multiple of 8


def test_clients_share_a_group_by_their_width_not_their_batch_size() -> None:
    class Runtime:
        model = nn.Linear(1, 1)

    pending = [Pending(i, j.instruction, j, LocalStep()) for i, j in enumerate(job(40, b) for b in (10, 12, 16, 20, 5))]
    width = functools.partial(batch_width, base=16, largest=40)
    found = groups(pending, None, 2**30, Runtime(), width)  # type: ignore[arg-type]
    assert sorted(sorted(p.index for p in group) for group in found) == [[0, 1, 2], [3], [4]]  # 16, 32, 8 rows
