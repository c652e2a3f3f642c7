"""FedBN: BatchNorm found by module type and kept local (weights and statistics), the rest is FedAvg."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from fedweave import runner
from fedweave.strategies.base import StrategyContext
from fedweave.strategies.fedbn import FedBN, FedBNClient, FedBNHParams, batch_norm_keys
from fedweave.task import build_model
from fedweave.training import ClientJob
from fedweave.types import Params, TaskKind

from conftest import assert_same_params, comparable, run_interrupted, run_to_end, small_config

from .conftest import tiny_data, tiny_job, tiny_params

LR = 0.1
EPS = 1e-5
BN = ("features.1.weight", "features.1.bias", "features.1.running_mean", "features.1.running_var")
COUNT = "features.1.num_batches_tracked"
CNN_BN = [
    "task.dataset=digits",
    "task.dataset_options={}",
    "task.model=cnn",
    "task.model_options={batch_norm: true, channels: [4], hidden: 16}",
    "local.epochs=1",
]


class TinyBN(nn.Module):
    """Tiny with a BatchNorm1d between ``features``' linear map and the head."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Linear(2, 2, bias=False), nn.BatchNorm1d(2))
        self.head = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def bn_params(gamma: list[float], beta: list[float], mean: list[float], var: list[float], count: int) -> Params:
    tiny = tiny_params()
    values = [torch.tensor(v, dtype=torch.float64) for v in (gamma, beta, mean, var)]
    return {
        "features.0.weight": tiny["features.weight"],
        **dict(zip(BN, values)),
        COUNT: torch.tensor(count),
        "head.weight": tiny["head.weight"],
        "head.bias": tiny["head.bias"],
    }


def bn_job(
    params: Params, client_id: int, rows: int, state: dict | None = None, task: TaskKind = TaskKind.TRAIN
) -> ClientJob:
    """A :func:`tiny_job` on :class:`TinyBN` with ``params`` and the first ``rows`` samples."""
    job = tiny_job(tiny_params(), client_id=client_id, local_steps=2, lr=LR, state=state, task=task)
    model = TinyBN().double()
    model.load_state_dict(params)
    x, y = tiny_data()
    instruction = dataclasses.replace(job.instruction, params=params)
    return dataclasses.replace(job, model=model, instruction=instruction, x_train=x[:rows], y_train=y[:rows])


def descend(start: Params, x: torch.Tensor, y: torch.Tensor, steps: int) -> Params:
    """Full-batch gradient descent through BatchNorm in training mode, with its running statistics."""
    trainable = ("features.0.weight", *BN[:2], "head.weight", "head.bias")
    w = {k: start[k].clone().requires_grad_(True) for k in trainable}
    mean, var, count = start[BN[2]].clone(), start[BN[3]].clone(), start[COUNT].clone()
    for _ in range(steps):
        z = x @ w["features.0.weight"].T
        mu, biased, unbiased = z.mean(0), z.var(0, unbiased=False), z.var(0, unbiased=True)
        normed = (z - mu) / torch.sqrt(biased + EPS) * w[BN[0]] + w[BN[1]]
        loss = ((normed @ w["head.weight"].T + w["head.bias"] - y) ** 2).mean()
        grads = torch.autograd.grad(loss, list(w.values()))
        w = {k: (v - LR * g).detach().requires_grad_(True) for (k, v), g in zip(w.items(), grads)}
        mean, var, count = 0.9 * mean + 0.1 * mu.detach(), 0.9 * var + 0.1 * unbiased.detach(), count + 1
    return {**{k: v.detach() for k, v in w.items()}, BN[2]: mean, BN[3]: var, COUNT: count}


def test_batch_norm_layers_are_found_by_module_type() -> None:
    cnn = build_model("cnn", input_shape=(1, 8, 8), num_classes=10, options={"batch_norm": True})
    stats = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")
    assert set(batch_norm_keys(cnn)) == {f"features.{i}.{k}" for i in (1, 5) for k in stats}
    assert batch_norm_keys(build_model("cnn", input_shape=(1, 8, 8), num_classes=10)) == []
    assert batch_norm_keys(nn.BatchNorm1d(3)) == list(stats)


def test_one_round_by_hand_client_and_server() -> None:
    glob = bn_params([1.0, 1.0], [0.0, 0.0], [0.0, 0.0], [1.0, 1.0], 0)
    own = bn_params([1.5, 0.5], [-0.2, 0.3], [0.3, -0.1], [2.0, 0.5], 5)
    x, y = tiny_data()
    client = FedBNClient(FedBNHParams())
    jobs = [bn_job(glob, 0, 4, state={"local": {k: own[k] for k in (*BN, COUNT)}}), bn_job(glob, 1, 3)]
    updates = [client.train(job) for job in jobs]

    trained = [descend({**glob, **{k: own[k] for k in (*BN, COUNT)}}, x, y, 2), descend(glob, x[:3], y[:3], 2)]
    shared = ("features.0.weight", "head.weight", "head.bias")
    for update, job, want in zip(updates, jobs, trained):
        assert set(update.tensors) == set(shared)
        assert_same_params(update.tensors, {k: want[k] - glob[k] for k in shared}, atol=1e-10)
        assert_same_params(job.state["local"], {k: want[k] for k in (*BN, COUNT)}, atol=1e-10)
    assert int(jobs[0].state["local"][COUNT]) == 7

    new = FedBN(FedBNHParams(), StrategyContext(num_clients=2)).aggregate(1, glob, updates)
    mean = {k: (4 * trained[0][k] + 3 * trained[1][k]) / 7 for k in shared}
    assert_same_params(new, {**glob, **mean}, atol=1e-10)


def test_evaluate_uses_the_local_batch_norm() -> None:
    glob = bn_params([1.0, 1.0], [0.0, 0.0], [0.0, 0.0], [1.0, 1.0], 0)
    own = bn_params([1.5, 0.5], [-0.2, 0.3], [0.3, -0.1], [2.0, 0.5], 5)
    job = bn_job(glob, 0, 4, state={"local": {k: own[k] for k in (*BN, COUNT)}}, task=TaskKind.EVALUATE)
    x, y = tiny_data()
    z = x @ own["features.0.weight"].T
    normed = (z - own[BN[2]]) / torch.sqrt(own[BN[3]] + EPS) * own[BN[0]] + own[BN[1]]
    expected = ((normed @ own["head.weight"].T + own["head.bias"] - y) ** 2).mean()
    assert abs(FedBNClient(FedBNHParams()).evaluate(job).metrics["loss"] - float(expected)) < 1e-10


def test_without_batch_norm_it_is_fedavg(tmp_path: Path) -> None:
    fedbn, fedbn_records = run_to_end(tmp_path / "fedbn", "strategy.name=fedbn")
    fedavg, fedavg_records = run_to_end(tmp_path / "fedavg", "strategy.name=fedavg")
    assert_same_params(fedbn, fedavg)
    assert comparable(fedbn_records) == comparable(fedavg_records)


def test_local_batch_norm_persists_and_is_evaluated(tmp_path: Path) -> None:
    r = runner.prepare(small_config("strategy.name=fedbn", "eval.federated_every=1", *CNN_BN), tmp_path)
    initial = {k: v.clone() for k, v in r.params.items()}
    records = runner.execute(r)
    assert all("federated_accuracy" in record for record in records)
    keys = [f"features.1.{k}" for k in ("weight", "bias", "running_mean", "running_var")]
    states = r.store.state_dict()
    assert sorted(states) == [0, 1, 2, 3]
    for key in keys:
        assert not torch.equal(states[0]["local"][key], states[1]["local"][key])
        assert torch.equal(r.params[key], initial[key])
    assert not torch.equal(r.params["features.0.weight"], initial["features.0.weight"])


def test_resume_is_identical(tmp_path: Path) -> None:
    overrides = ("strategy.name=fedbn", "eval.federated_every=1", *CNN_BN)
    straight, straight_records = run_to_end(tmp_path / "a", *overrides)
    resumed, resumed_records = run_interrupted(tmp_path / "b", 1, *overrides)
    assert_same_params(straight, resumed)
    assert comparable(straight_records) == comparable(resumed_records)
