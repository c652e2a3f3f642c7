"""Tests of fedweave.training: the optimiser matches torch.optim, the local loop's steps and batches, the training
seam a wrapper takes over, what an instruction may change."""

from __future__ import annotations

import dataclasses
import pytest
import torch
from torch import nn

from fedweave.errors import ConfigError
from fedweave.training import (
    SGD_LOOP,
    ClientJob,
    Hooks,
    LocalOptimizer,
    LocalSettings,
    LossHook,
    TrainResult,
    delta_update,
    instructed,
    model_delta,
    round_steps,
    rows,
    train_local,
)
from fedweave.types import UpdateKind, Work

from strategies.conftest import Tiny, mse, tiny_data, tiny_job, tiny_params

OPTIMISERS = [
    ("sgd", 0.0, 0.0),
    ("sgd", 0.9, 0.0),
    ("sgd", 0.0, 0.01),
    ("sgd", 0.5, 0.1),
    ("adam", 0.0, 0.0),
    ("adam", 0.0, 0.01),
]


def torch_optimizer(
    params: list[nn.Parameter], optimizer: str, lr: float, momentum: float, weight_decay: float
) -> torch.optim.Optimizer:
    if optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay, foreach=False)
    return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay, foreach=False)


def tiny_model() -> Tiny:
    model = Tiny().double()
    model.load_state_dict(tiny_params())
    return model


@pytest.mark.parametrize(("optimizer", "momentum", "weight_decay"), OPTIMISERS)
def test_local_optimizer_equals_torch_optim_step_by_step(optimizer: str, momentum: float, weight_decay: float) -> None:
    lr = 0.05
    ours, reference = tiny_model(), tiny_model()
    local = LocalOptimizer(ours.parameters(), LocalSettings(optimizer, lr, momentum, weight_decay))
    torch_opt = torch_optimizer(list(reference.parameters()), optimizer, lr, momentum, weight_decay)
    x, y = tiny_data()
    for _ in range(6):
        for model, opt in ((ours, local), (reference, torch_opt)):
            opt.zero_grad()
            mse(model(x), y).backward()
            opt.step()
        for (name, p), q in zip(ours.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-12, msg=lambda m: f"{name}: {m}")
    assert local.steps == 6


class TwoBranches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.tensor([1.0, -2.0], dtype=torch.float64))
        self.b = nn.Parameter(torch.tensor([0.5, 3.0], dtype=torch.float64))

    def loss(self, use_b: bool) -> torch.Tensor:
        value = (self.a**2).sum()
        return value + ((self.b - self.a) ** 2).sum() if use_b else value


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_parameter_without_gradient_is_skipped_as_torch_does(optimizer: str) -> None:
    """Adam's bias correction counts the steps each parameter took, not the calls."""
    ours, reference = TwoBranches(), TwoBranches()
    local = LocalOptimizer(ours.parameters(), LocalSettings(optimizer, 0.1, 0.9 if optimizer == "sgd" else 0.0, 0.0))
    torch_opt = torch_optimizer(list(reference.parameters()), optimizer, 0.1, 0.9 if optimizer == "sgd" else 0.0, 0.0)
    for step in range(4):
        for model, opt in ((ours, local), (reference, torch_opt)):
            opt.zero_grad()
            model.loss(use_b=step > 0).backward()
            opt.step()
        torch.testing.assert_close(ours.a, reference.a, rtol=0, atol=1e-12)
        torch.testing.assert_close(ours.b, reference.b, rtol=0, atol=1e-12)


def test_frozen_parameters_are_left_alone() -> None:
    model = tiny_model()
    model.head.bias.requires_grad_(False)
    optimizer = LocalOptimizer(model.parameters(), LocalSettings("sgd", 0.1, 0.0, 0.0))
    assert len(optimizer.params) == 2
    x, y = tiny_data()
    mse(model(x), y).backward()
    optimizer.step()
    assert model.head.bias.item() == 0.1


# --------------------------------------------------------------------------- train_local


def spy(batches: list[torch.Tensor]) -> LossHook:
    """A loss hook that records each batch's targets and reports the batch size as its loss."""

    def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batches.append(y.detach().clone())
        return mse(model(x), y), torch.tensor(float(len(y)))

    return loss


def numbered_job(samples: int, seed: int = 0, **work: int | None) -> ClientJob:
    """A tiny job whose targets number its samples 0..samples-1, to trace batches."""
    job = tiny_job(**work)
    x = torch.linspace(-1, 1, samples * 2, dtype=torch.float64).reshape(samples, 2)
    y = torch.arange(samples, dtype=torch.float64).reshape(samples, 1)
    return dataclasses.replace(job, x_train=x, y_train=y, generator=torch.Generator().manual_seed(seed))


def test_epochs_cover_every_sample_once_with_a_partial_last_batch() -> None:
    batches: list[torch.Tensor] = []
    result = train_local(numbered_job(4, batch_size=3, epochs=3), loss=spy(batches))
    assert [len(b) for b in batches] == [3, 1, 3, 1, 3, 1]
    assert result.steps == 6 and result.num_examples == 4
    for epoch in range(3):
        seen = torch.cat(batches[2 * epoch : 2 * epoch + 2]).flatten()
        assert sorted(seen.tolist()) == [0.0, 1.0, 2.0, 3.0]
    # reported losses are the batch sizes: the sample-weighted mean is (3·3 + 1·1) / 4
    assert result.mean_loss == pytest.approx(2.5, abs=1e-12)


def test_local_steps_override_epochs_and_run_across_epochs() -> None:
    batches: list[torch.Tensor] = []
    result = train_local(numbered_job(4, batch_size=3, epochs=7, local_steps=5), loss=spy(batches))
    assert result.steps == 5
    assert [len(b) for b in batches] == [3, 1, 3, 1, 3]
    assert sorted(torch.cat(batches[2:4]).flatten().tolist()) == [0.0, 1.0, 2.0, 3.0]


def test_round_steps_count_the_loops_steps() -> None:
    # 27 rows in batches of 16: 2 a pass, 3 passes; 5 rows: one batch of 5 a pass; steps set: exactly those
    assert round_steps(Work(0, batch_size=16, epochs=3), 27) == 6
    assert round_steps(Work(0, batch_size=16, epochs=3), 5) == 3
    assert round_steps(Work(0, batch_size=16, epochs=3, local_steps=4), 27) == 4
    assert round_steps(Work(0, batch_size=16, epochs=3), 0) == 0
    for n, batch, epochs in ((4, 3, 3), (5, 64, 2), (16, 4, 1)):
        job = numbered_job(n, batch_size=batch, epochs=epochs)
        assert train_local(job).steps == round_steps(job.instruction.work, n)


def test_a_batch_larger_than_the_data_is_the_whole_data() -> None:
    batches: list[torch.Tensor] = []
    result = train_local(numbered_job(5, batch_size=64, epochs=2), loss=spy(batches))
    assert result.steps == 2 and [len(b) for b in batches] == [5, 5]


def test_shuffling_is_seeded() -> None:
    def order(seed: int) -> list[float]:
        batches: list[torch.Tensor] = []
        train_local(numbered_job(16, seed=seed, batch_size=4, epochs=2), loss=spy(batches))
        return torch.cat(batches).flatten().tolist()

    first = order(0)
    assert first == order(0)
    assert first != order(1)
    assert first[:16] != first[16:]  # each epoch draws a new permutation


def test_same_job_same_result() -> None:
    one, two = tiny_job(batch_size=2, epochs=2), tiny_job(batch_size=2, epochs=2)
    train_local(one)
    train_local(two)
    for p, q in zip(one.model.parameters(), two.model.parameters()):
        assert torch.equal(p, q)


def test_after_backward_runs_once_per_step_before_the_step() -> None:
    calls = []

    def drop_gradients(model: nn.Module) -> None:
        calls.append(1)
        for p in model.parameters():
            assert p.grad is not None
            p.grad.zero_()

    job = tiny_job(batch_size=3, epochs=2)
    train_local(job, after_backward=drop_gradients)
    assert len(calls) == 4
    for name, value in job.model.state_dict().items():
        assert torch.equal(value, tiny_params()[name])


def test_an_explicit_model_is_trained_instead_of_the_jobs() -> None:
    job = tiny_job()
    personal = tiny_model()
    train_local(job, model=personal)
    assert torch.equal(job.model.head.bias, tiny_params()["head.bias"])
    assert not torch.equal(personal.head.bias, tiny_params()["head.bias"])


def test_no_data_no_steps() -> None:
    job = tiny_job()
    empty = dataclasses.replace(job, x_train=job.x_train[:0], y_train=job.y_train[:0])
    result = train_local(empty)
    assert (result.steps, result.num_examples) == (0, 0)
    assert result.mean_loss != result.mean_loss  # NaN


def test_model_delta() -> None:
    model = nn.BatchNorm1d(2)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    model.weight.data += torch.tensor([0.5, -1.0])
    model.num_batches_tracked += 3
    delta = model_delta(model, start)
    torch.testing.assert_close(delta["weight"], torch.tensor([0.5, -1.0]), rtol=0, atol=0)
    torch.testing.assert_close(delta["bias"], torch.zeros(2), rtol=0, atol=0)
    assert delta["num_batches_tracked"].item() == 3  # integer buffers travel as values


def test_delta_update_sends_the_change_of_the_model_with_the_counts_of_its_training() -> None:
    model = nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 2.0]]))
        model.bias.fill_(0.5)
    start = {"weight": torch.tensor([[0.25, 2.5]]), "bias": torch.tensor([1.0])}
    control = {"c": torch.tensor([4.0])}
    update = delta_update(TrainResult(steps=3, num_examples=12, mean_loss=0.75), model_delta(model, start), control)
    assert update.kind is UpdateKind.DELTA
    torch.testing.assert_close(update.tensors["weight"], torch.tensor([[0.75, -0.5]]), rtol=0, atol=0)
    torch.testing.assert_close(update.tensors["bias"], torch.tensor([-0.5]), rtol=0, atol=0)
    assert (update.num_examples, update.local_steps, update.metrics) == (12, 3, {"train_loss": 0.75})
    assert list(update.extras) == ["c"] and update.extras["c"].item() == 4.0
    assert delta_update(TrainResult(steps=0, num_examples=0, mean_loss=0.0), {}).extras == {}


def test_rows_is_indexing() -> None:
    x = torch.arange(24.0).reshape(6, 2, 2)
    for index in (torch.tensor([4, 0, 4]), torch.randperm(6)[1:4], torch.tensor([], dtype=torch.long)):
        got = rows(x, index)
        assert torch.equal(got, x[index]) and got.stride() == x[index].stride()
    assert torch.equal(rows(x, torch.tensor([1, 3], dtype=torch.int32)), x[[1, 3]])  # other index dtypes: x[index]
    assert torch.equal(rows(x, torch.tensor([True, False, True, False, False, True])), x[[0, 2, 5]])
    assert torch.equal(rows(torch.arange(6), torch.tensor([5, 1])), torch.tensor([5, 1]))


class Recording:
    """A wrapper that takes the loop over: it records what it was handed and runs the plain loop."""

    def __init__(self) -> None:
        self.calls: list[Hooks] = []

    def train(self, job: ClientJob, hooks: Hooks) -> TrainResult:
        self.calls.append(hooks)
        return SGD_LOOP.train(job, hooks)

    def report(self) -> dict[str, float]:
        return {"recording_calls": float(len(self.calls))}


def test_train_local_runs_the_training_the_job_carries_with_the_strategys_hooks() -> None:
    plain, wrapped = tiny_job(batch_size=2, epochs=2), tiny_job(batch_size=2, epochs=2)
    assert plain.training is SGD_LOOP and SGD_LOOP.report() == {}
    wrapped.training = Recording()
    hook = lambda model: None  # noqa: E731
    assert train_local(wrapped, after_backward=hook) == train_local(plain, after_backward=hook)
    assert wrapped.training.calls == [Hooks(after_backward=hook)]
    for p, q in zip(plain.model.parameters(), wrapped.model.parameters()):
        assert torch.equal(p, q)


def test_an_instruction_changes_the_settings_and_work_it_names_and_nothing_else() -> None:
    settings, work = LocalSettings("sgd", 0.1, 0.5, 0.0), Work(3, batch_size=8, epochs=1, local_steps=4)
    assert instructed(settings, work, {"accepted_round": 2}) == (settings, work)
    changed = instructed(settings, work, {"lr": 1, "optimizer": "adam", "epochs": 2, "batch_size": 4})
    assert changed == (LocalSettings("adam", 1.0, 0.5, 0.0), Work(3, batch_size=4, epochs=2, local_steps=None))
    assert isinstance(changed[0].lr, float)  # an integer widens, as in the config
    assert instructed(settings, work, {"steps": 7})[1] == Work(3, batch_size=8, epochs=1, local_steps=7)
    with pytest.raises(ConfigError, match=r"^config key 'weight_decay': must be >= 0, got -1.0$"):
        instructed(settings, work, {"weight_decay": -1.0})
    with pytest.raises(ConfigError, match=r"^config key 'optimizer': 'rmsprop' is not allowed"):
        instructed(settings, work, {"optimizer": "rmsprop"})
