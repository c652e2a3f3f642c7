"""SCAFFOLD: corrected local steps, both control-variate options and the server step by
hand; the first round is FedAvg; resume; config."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from conftest import assert_same_params, comparable, run_interrupted, run_to_end, small_config
from fedweave.errors import ConfigError
from fedweave.strategies.base import StrategyContext
from fedweave.strategies.fedavg import FedAvg, FedAvgClient, FedAvgHParams
from fedweave.strategies.scaffold import CONTROL, Scaffold, ScaffoldClient, ScaffoldHParams, full_gradient
from fedweave.training import ClientJob
from fedweave.types import Params, Update, UpdateKind, Work

from .conftest import tiny_data, tiny_job, tiny_params

LR, STEPS = 0.1, 3
X = tiny_params(0.8)  # the global model the clients receive
C = tiny_params(0.05)  # the server control variate
C_I = tiny_params(-0.03)  # the client's control variate


def task_loss(w: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = x @ w["features.weight"].T @ w["head.weight"].T + w["head.bias"]
    return ((out - y) ** 2).mean()


def gradient(w: Params, x: torch.Tensor, y: torch.Tensor) -> Params:
    leaves = {k: v.clone().requires_grad_() for k, v in w.items()}
    return dict(zip(leaves, torch.autograd.grad(task_loss(leaves, x, y), list(leaves.values()))))


def corrected_sgd(x: torch.Tensor, y: torch.Tensor, momentum: float) -> Params:
    """K steps of (momentum) SGD on g(y) − c_i + c from X, written out."""
    w, buf = X, None
    for _ in range(STEPS):
        g = {k: v - C_I[k] + C[k] for k, v in gradient(w, x, y).items()}
        buf = g if buf is None else {k: momentum * buf[k] + g[k] for k in g}
        w = {k: w[k] - LR * buf[k] for k in w}
    return w


def job(momentum: float = 0.0, second: bool = False, first_round: bool = False) -> ClientJob:
    """A client with C_I against server C, or, in the first round, with neither."""
    if first_round:
        j = tiny_job(X, local_steps=STEPS, lr=LR, momentum=momentum)
    else:
        j = tiny_job(X, local_steps=STEPS, lr=LR, momentum=momentum, extras=C, state={CONTROL: C_I})
    if second:
        x, y = tiny_data()
        j = dataclasses.replace(j, client_id=1, x_train=1.5 - x[1:], y_train=2 * y[1:] + 0.5)
    return j


@pytest.mark.parametrize(("momentum", "effective_steps"), [(0.0, 3.0), (0.5, 1 + 1.5 + 1.75)])
def test_option_two_client_by_hand(momentum: float, effective_steps: float) -> None:
    j = job(momentum)
    update = ScaffoldClient(ScaffoldHParams(option="II")).train(j)
    y = corrected_sgd(j.x_train, j.y_train, momentum)
    assert_same_params(update.tensors, {k: y[k] - X[k] for k in X}, atol=1e-12)
    new_control = {k: C_I[k] - C[k] + (X[k] - y[k]) / (effective_steps * LR) for k in X}
    assert_same_params(j.state[CONTROL], new_control, atol=1e-12)
    assert_same_params(update.extras, {k: new_control[k] - C_I[k] for k in X}, atol=1e-12)


def test_option_one_client_by_hand() -> None:
    j = job(second=True)
    update = ScaffoldClient(ScaffoldHParams(option="I")).train(j)
    y = corrected_sgd(j.x_train, j.y_train, 0.0)
    assert_same_params(update.tensors, {k: y[k] - X[k] for k in X}, atol=1e-12)
    at_x = gradient(X, j.x_train, j.y_train)
    assert_same_params(j.state[CONTROL], at_x, atol=1e-12)
    assert_same_params(update.extras, {k: at_x[k] - C_I[k] for k in X}, atol=1e-12)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_option_one_gradient_is_the_whole_data_mean_over_unequal_batches(batch_size: int) -> None:
    """∇f_i(x) over mini-batches (3 + 1 samples, or 4 of 1): each batch's mean loss weighted by its
    share of the data, not summed, nor averaged over batches alike (the short last batch)."""
    j = tiny_job(X, batch_size=batch_size)
    assert_same_params(full_gradient(j), gradient(X, j.x_train, j.y_train), atol=1e-12)
    assert_same_params(j.model.state_dict(), X)  # the model is back at x


def test_option_one_gradient_pass_leaves_batch_norm_statistics_alone() -> None:
    """The extra pass of option I must not move running statistics: Δy is FedAvg's."""

    def bn_job() -> ClientJob:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 1)).double()
        j = tiny_job(local_steps=2)
        start = {k: v.clone() for k, v in model.state_dict().items()}
        return dataclasses.replace(j, model=model, instruction=dataclasses.replace(j.instruction, params=start))

    scaffold = ScaffoldClient(ScaffoldHParams(option="I")).train(bn_job())
    fedavg = FedAvgClient(FedAvgHParams()).train(bn_job())
    assert_same_params(scaffold.tensors, fedavg.tensors)


def test_server_step_by_hand() -> None:
    client = ScaffoldClient(ScaffoldHParams())
    updates = [client.train(job()), client.train(job(second=True))]
    strategy = Scaffold(ScaffoldHParams(global_lr=0.5), StrategyContext(num_clients=4))
    strategy.load_state_dict({"control": C})
    (instruction,) = strategy.configure(1, X, [Work(0, 4)])
    assert_same_params(instruction.extras, C)
    new = strategy.aggregate(1, X, updates)
    dy = [u.tensors for u in updates]
    dc = [u.extras for u in updates]
    for k in X:
        want_x = X[k] + 0.5 * (4 * dy[0][k] + 3 * dy[1][k]) / 7
        want_c = C[k] + (2 / 4) * (dc[0][k] + dc[1][k]) / 2
        torch.testing.assert_close(new[k], want_x, rtol=0, atol=1e-12)
        torch.testing.assert_close(strategy.state_dict()["control"][k], want_c, rtol=0, atol=1e-12)


def test_first_round_with_zero_control_variates_is_fedavg_exactly() -> None:
    scaffold = [ScaffoldClient(ScaffoldHParams()).train(job(second=s, first_round=True)) for s in (False, True)]
    fedavg = [FedAvgClient(FedAvgHParams()).train(job(second=s, first_round=True)) for s in (False, True)]
    for a, b in zip(scaffold, fedavg):
        assert_same_params(a.tensors, b.tensors)
    ctx = StrategyContext(num_clients=2)
    assert_same_params(
        Scaffold(ScaffoldHParams(), ctx).aggregate(1, X, scaffold), FedAvg(FedAvgHParams(), ctx).aggregate(1, X, fedavg)
    )


def test_first_round_run_is_the_fedavg_run(tmp_path: Path) -> None:
    params, records = run_to_end(tmp_path / "s", "strategy.name=scaffold", "rounds=1")
    expected, expected_records = run_to_end(tmp_path / "a", "strategy.name=fedavg", "rounds=1")
    assert_same_params(params, expected)
    assert records[0]["test_accuracy"] == expected_records[0]["test_accuracy"]


def test_resume_is_bit_identical(tmp_path: Path) -> None:
    params, records = run_interrupted(tmp_path / "r", 1, "strategy.name=scaffold", "sample_fraction=0.5")
    expected, expected_records = run_to_end(tmp_path / "e", "strategy.name=scaffold", "sample_fraction=0.5")
    assert_same_params(params, expected)
    assert comparable(records) == comparable(expected_records)


def test_config_loads_and_checks_ranges() -> None:
    hp = small_config("strategy.name=scaffold", "strategy.option=I", "strategy.global_lr=0.5").strategy.params
    assert (hp.option, hp.global_lr) == ("I", 0.5)
    with pytest.raises(ConfigError, match="strategy.option"):
        small_config("strategy.name=scaffold", "strategy.option=III")
    with pytest.raises(ConfigError, match="strategy.global_lr"):
        small_config("strategy.name=scaffold", "strategy.global_lr=0")


def test_running_statistics_take_the_plain_average() -> None:
    strategy = Scaffold(ScaffoldHParams(global_lr=2.0), StrategyContext(num_clients=2))
    x = {"w": torch.tensor([1.0]), "bn.running_var": torch.tensor([1.0])}
    updates = [
        Update(
            kind=UpdateKind.DELTA,
            tensors={"w": torch.tensor([0.5]), "bn.running_var": torch.tensor([v])},
            num_examples=1,
            extras={"w": torch.tensor([0.1])},
        )
        for v in (-0.6, -0.8)
    ]
    new = strategy.aggregate(1, x, updates)
    assert new["bn.running_var"].item() == pytest.approx(0.3)
    assert new["w"].item() == pytest.approx(2.0)


def test_krum_keeps_the_same_client_for_model_and_control_deltas() -> None:
    """Five clients: model deltas make client 0 central, control deltas make client 1
    central; Krum's joint pass picks one client and takes both of its deltas."""
    from functools import partial

    from fedweave.strategies.aggregate import kept_indices
    from fedweave.strategies.robust import krum_scores, multi_krum

    def update(d: float, c: float) -> Update:
        return Update(
            UpdateKind.DELTA,
            {k: torch.full_like(v, d) for k, v in X.items()},
            10,
            extras={k: torch.full_like(v, c) for k, v in X.items()},
        )

    updates = [update(0.0, 5.0), update(0.1, 0.0), update(-0.1, 0.2), update(1.0, -0.2), update(-1.0, 3.0)]
    krum = partial(multi_krum, byzantine=1, select=1)
    # Krum run on each half alone would pick different clients.
    assert int(krum_scores([u.tensors for u in updates], 1).argmin()) == 0
    assert int(krum_scores([u.extras for u in updates], 1).argmin()) == 1
    strategy = Scaffold(ScaffoldHParams(), StrategyContext(num_clients=5, average=krum))
    new = strategy.aggregate(1, X, updates)
    joined = [{**u.tensors, **{f"c.{k}": v for k, v in u.extras.items()}} for u in updates]
    chosen = int(krum_scores(joined, 1).argmin())
    assert chosen == 1  # by hand: 2 nearest squared distances per entry 0.08 + 0.85, the least
    assert kept_indices(new, 5) == [chosen]  # only client 1's update counts as applied
    for k in X:
        torch.testing.assert_close(new[k], X[k] + updates[chosen].tensors[k], rtol=0, atol=1e-12)
        torch.testing.assert_close(
            strategy.state_dict()["control"][k], (1 / 5) * updates[chosen].extras[k], rtol=0, atol=1e-12
        )


def test_option_two_extras_give_back_the_raw_delta_so_client_level_dp_is_refused() -> None:
    """Issue 14's leak: Δc_i = −c − Δy_i/(K·η_l), so the server rebuilds the un-noised Δy_i from
    the extras, whatever noise dp_local adds to the tensors; such a config is refused at load."""
    j = job()
    update = ScaffoldClient(ScaffoldHParams(option="II")).train(j)
    rebuilt = {k: -(update.extras[k] + C[k]) * STEPS * LR for k in X}
    assert_same_params(rebuilt, update.tensors, atol=1e-12)
    with pytest.raises(ConfigError, match="'plugins.client_send\\[0\\]': plugin 'dp_local' cannot protect"):
        small_config("strategy.name=scaffold", "plugins.client_send=[{name: dp_local}]")
    # with DP-SGD, Δy_i is the output of private training and Δc_i a function of it and of c
    assert small_config("strategy.name=scaffold", "plugins.client_receive=[dpsgd]").strategy.params.option == "II"
