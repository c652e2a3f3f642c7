"""DiLoCo: the inner AdamW against torch's, a round and the outer Nesterov step by hand, FedAvg reduction, resume."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from fedweave.strategies.base import StrategyContext
from fedweave.strategies.diloco import DiLoCo, DiLoCoClient, DiLoCoHParams, InnerAdamW
from fedweave.types import Params, Update, UpdateKind

from conftest import assert_same_params, comparable, run_interrupted, run_to_end

from .conftest import tiny_data, tiny_job, tiny_params

HP = DiLoCoHParams(
    outer_lr=0.7, outer_momentum=0.9, inner_lr=0.05, inner_weight_decay=0.1, beta1=0.8, beta2=0.95, eps=1e-6
)


def test_inner_adamw_equals_torch_adamw_and_resumes_from_its_state() -> None:
    generator = torch.Generator().manual_seed(0)
    ours, theirs = nn.Linear(3, 2).double(), nn.Linear(3, 2).double()
    theirs.load_state_dict(ours.state_dict())
    reference = torch.optim.AdamW(
        theirs.parameters(), lr=HP.inner_lr, betas=(HP.beta1, HP.beta2), eps=HP.eps, weight_decay=HP.inner_weight_decay
    )
    optimizer = InnerAdamW(ours, HP, {})
    for step in range(6):
        if step == 3:  # a new round: the optimiser is rebuilt from the state the client kept
            optimizer = InnerAdamW(ours, HP, optimizer.saved())
        grads = [torch.randn(p.shape, dtype=torch.float64, generator=generator) for p in ours.parameters()]
        for model in (ours, theirs):
            for p, g in zip(model.parameters(), grads):
                p.grad = g.clone()
        optimizer.step()
        reference.step()
        assert_same_params(ours.state_dict(), theirs.state_dict())
    assert all(int(s["step"]) == 6 for s in optimizer.saved().values())


def adamw(w: Params, grad: Params, state: dict[str, dict], lr: float) -> Params:
    """One AdamW step (Loshchilov & Hutter) from its equations; updates ``state`` in place."""
    out = {}
    for k in w:
        s = state.setdefault(k, {"m": torch.zeros_like(w[k]), "v": torch.zeros_like(w[k]), "t": 0})
        s["t"] += 1
        s["m"] = HP.beta1 * s["m"] + (1 - HP.beta1) * grad[k]
        s["v"] = HP.beta2 * s["v"] + (1 - HP.beta2) * grad[k] ** 2
        m_hat, v_hat = s["m"] / (1 - HP.beta1 ** s["t"]), s["v"] / (1 - HP.beta2 ** s["t"])
        out[k] = w[k] * (1 - lr * HP.inner_weight_decay) - lr * m_hat / (v_hat.sqrt() + HP.eps)
    return out


def inner_steps(start: Params, x: torch.Tensor, y: torch.Tensor, steps: int, state: dict[str, dict]) -> Params:
    """H full-batch AdamW steps on Tiny's MSE; returns the trained parameters."""
    w = dict(start)
    for _ in range(steps):
        v = {k: t.clone().requires_grad_(True) for k, t in w.items()}
        out = x @ v["features.weight"].T @ v["head.weight"].T + v["head.bias"]
        grads = torch.autograd.grad(((out - y) ** 2).mean(), list(v.values()))
        w = adamw(w, dict(zip(v, grads)), state, HP.inner_lr)
    return w


def test_two_rounds_by_hand_client_and_server() -> None:
    x, y = tiny_data()
    client = DiLoCoClient(HP)
    server = DiLoCo(HP, StrategyContext(num_clients=2))
    theta = tiny_params()
    hand_theta, hand_states = tiny_params(), [{}, {}]
    states: list[dict] = [{}, {}]
    momentum: Params = {}
    for rnd in (1, 2):
        jobs = [tiny_job(theta, client_id=c, rnd=rnd, local_steps=2, state=states[c]) for c in (0, 1)]
        jobs[1] = dataclasses.replace(jobs[1], x_train=x[:3], y_train=y[:3])
        updates = [client.train(job) for job in jobs]
        states = [job.state for job in jobs]
        theta = server.aggregate(rnd, theta, updates)

        trained = [inner_steps(hand_theta, x[:n], y[:n], 2, s) for n, s in zip((4, 3), hand_states)]
        deltas = [{k: t[k] - hand_theta[k] for k in t} for t in trained]
        for update, delta in zip(updates, deltas):
            assert_same_params(update.tensors, delta, atol=1e-10)
        grad = {k: -(4 * deltas[0][k] + 3 * deltas[1][k]) / 7 for k in hand_theta}
        momentum = {k: HP.outer_momentum * momentum.get(k, 0) + grad[k] for k in grad}
        hand_theta = {k: hand_theta[k] - HP.outer_lr * (grad[k] + HP.outer_momentum * momentum[k]) for k in grad}
        assert_same_params(theta, hand_theta, atol=1e-10)
        assert all(int(s["step"]) == 2 * rnd for s in states[0]["inner"].values())


def test_outer_step_leaves_running_statistics_and_counters_to_the_average() -> None:
    params = {
        "w": torch.tensor([1.0, -2.0]),
        "bn.running_var": torch.tensor([0.5]),
        "bn.num_batches_tracked": torch.tensor(4),
    }

    def update(dw: list[float], dvar: float, count: int) -> Update:
        values = (torch.tensor(dw), torch.tensor([dvar]), torch.tensor(count))
        return Update(kind=UpdateKind.DELTA, tensors=dict(zip(params, values)), num_examples=1)

    updates = [update([0.2, 0.4], -0.4, 6), update([0.0, 0.2], -0.2, 9)]
    new = DiLoCo(HP, StrategyContext(num_clients=2)).aggregate(1, params, updates)
    g = -torch.tensor([0.1, 0.3])  # minus the mean delta; the first momentum buffer is g itself
    expected = (params["w"] - 0.7 * (g + 0.9 * g), torch.tensor([0.2]), torch.tensor(9))
    assert_same_params(new, dict(zip(params, expected)), atol=1e-6)


def test_no_keep_inner_state_keeps_no_client_state() -> None:
    job = tiny_job(local_steps=2)
    DiLoCoClient(dataclasses.replace(HP, keep_inner_state=False)).train(job)
    assert job.state == {}


def test_outer_lr_one_momentum_zero_is_fedavg_with_the_same_inner_optimiser(tmp_path: Path) -> None:
    diloco, diloco_records = run_to_end(
        tmp_path / "diloco",
        "strategy.name=diloco",
        "strategy.outer_lr=1",
        "strategy.outer_momentum=0",
        "strategy.keep_inner_state=false",
        "strategy.inner_weight_decay=0",
        "strategy.inner_lr=0.01",
    )
    fedavg, fedavg_records = run_to_end(tmp_path / "fedavg", "local.optimizer=adam", "local.lr=0.01")
    assert_same_params(diloco, fedavg)
    assert comparable(diloco_records) == comparable(fedavg_records)


def test_resume_is_identical(tmp_path: Path) -> None:
    straight, straight_records = run_to_end(tmp_path / "a", "strategy.name=diloco")
    resumed, resumed_records = run_interrupted(tmp_path / "b", 1, "strategy.name=diloco")
    assert_same_params(straight, resumed)
    assert comparable(straight_records) == comparable(resumed_records)
