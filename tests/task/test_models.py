"""Tests of fedweave.task.models: the features/head contract, options, user factories, loss, evaluate."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch
from torch import nn

from fedweave.errors import TaskError
from fedweave.task import CNN, MLP, build_model, evaluate, load_dataset, make_loss

SHAPES = [(1, 8, 8), (1, 28, 28), (3, 32, 32)]


@pytest.mark.parametrize("spec", ["mlp", "cnn"])
@pytest.mark.parametrize("shape", SHAPES)
def test_output_shapes_and_features_head_contract(spec: str, shape: tuple[int, ...]) -> None:
    model = build_model(spec, input_shape=shape, num_classes=7, seed=0)
    x = torch.rand(5, *shape, generator=torch.Generator().manual_seed(0))
    representation = model.features(x)
    assert representation.ndim == 2 and representation.shape[0] == 5
    assert isinstance(model.head, nn.Linear) and model.head.in_features == representation.shape[1]
    assert model(x).shape == (5, 7)
    assert torch.equal(model(x), model.head(representation))
    names = [n for n, _ in model.named_parameters()]
    assert [n for n in names if n.startswith("head.")] == ["head.weight", "head.bias"]
    assert all(n.startswith(("features.", "head.")) for n in names)


def test_mlp_layer_sizes() -> None:
    model = build_model("mlp", input_shape=(1, 8, 8), num_classes=10, options={"hidden": [32, 16]})
    linears = [m for m in model.features if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(64, 32), (32, 16)]
    assert model.head.in_features == 16
    logistic = MLP((20,), 3, hidden=())
    assert logistic.features(torch.zeros(2, 20)).shape == (2, 20) and logistic.head.in_features == 20
    assert any(isinstance(m, nn.Dropout) for m in MLP((4,), 2, dropout=0.5).features)


def test_cnn_flattened_size_per_input() -> None:
    # two pooling stages with ceil: 8 -> 4 -> 2, 28 -> 14 -> 7, 32 -> 16 -> 8; 32 channels
    for (c, h, w), side in zip(SHAPES, [2, 7, 8]):
        fc = CNN((c, h, w), 10).features[-2]
        assert isinstance(fc, nn.Linear) and fc.in_features == 32 * side * side and fc.out_features == 64
    # three stages on 8x8 still work thanks to ceil_mode: 8 -> 4 -> 2 -> 1
    assert CNN((1, 8, 8), 10, channels=(4, 4, 4))(torch.zeros(2, 1, 8, 8)).shape == (2, 10)


def test_cnn_batch_norm_adds_untouched_buffers() -> None:
    plain = build_model("cnn", input_shape=(1, 8, 8), num_classes=10)
    with_bn = build_model("cnn", input_shape=(1, 8, 8), num_classes=10, options={"batch_norm": True})
    assert not any("running_mean" in k for k in plain.state_dict())
    bn_keys = [k for k in with_bn.state_dict() if k.endswith("running_mean")]
    assert len(bn_keys) == 2
    bns = [m for m in with_bn.modules() if isinstance(m, nn.BatchNorm2d)]
    # the dummy forward that sizes the FC layer must not have updated the statistics
    assert all(int(bn.num_batches_tracked) == 0 and float(bn.running_mean.abs().sum()) == 0.0 for bn in bns)
    assert with_bn.training


def test_cnn_needs_image_input() -> None:
    expected = r"needs images shaped \(channels, height, width\), got input_shape \(20,\)"
    with pytest.raises(TaskError, match=expected):
        build_model("cnn", input_shape=(20,), num_classes=10)


def test_seed_makes_weights_reproducible_without_touching_global_rng() -> None:
    state = torch.get_rng_state()
    a = build_model("mlp", input_shape=(4,), num_classes=3, seed=11)
    b = build_model("mlp", input_shape=(4,), num_classes=3, seed=11)
    c = build_model("mlp", input_shape=(4,), num_classes=3, seed=12)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
    assert not torch.equal(a.head.weight, c.head.weight)


def test_unknown_and_bad_options() -> None:
    with pytest.raises(TaskError, match="model 'mlp': unknown option width; valid: hidden, dropout"):
        build_model("mlp", input_shape=(4,), num_classes=2, options={"width": 3})
    with pytest.raises(TaskError, match="valid: channels, hidden, batch_norm"):
        build_model("cnn", input_shape=(1, 8, 8), num_classes=2, options={"dropout": 0.1})
    with pytest.raises(TaskError, match="hidden must be positive integers"):
        build_model("mlp", input_shape=(4,), num_classes=2, options={"hidden": [8, 0]})
    with pytest.raises(TaskError, match="dropout must lie in"):
        build_model("mlp", input_shape=(4,), num_classes=2, options={"dropout": 1.0})


def test_unknown_spec_lists_models() -> None:
    with pytest.raises(TaskError, match="unknown model 'resnet'; valid: mlp, cnn or package.module:function"):
        build_model("resnet", input_shape=(4,), num_classes=2)


def test_user_factories(user_module: Callable[[str], str]) -> None:
    name = user_module(
        """
        from torch import nn

        def sized(input_shape, num_classes, width=3):
            return nn.Linear(input_shape[0] * width, num_classes)

        def fixed(width):
            return nn.Linear(width, 2)

        def kwargs_only(**kwargs):
            return nn.Linear(kwargs["input_shape"][0], kwargs["num_classes"])

        def not_a_module(input_shape, num_classes):
            return "linear"
        """
    )
    sized = build_model(f"{name}:sized", input_shape=(4,), num_classes=5, options={"width": 2})
    assert (sized.in_features, sized.out_features) == (8, 5)
    fixed = build_model(f"{name}:fixed", input_shape=(4,), num_classes=5, options={"width": 6})
    assert (fixed.in_features, fixed.out_features) == (6, 2)
    loose = build_model(f"{name}:kwargs_only", input_shape=(3,), num_classes=4)
    assert (loose.in_features, loose.out_features) == (3, 4)
    with pytest.raises(TaskError, match="must return a torch.nn.Module, got str"):
        build_model(f"{name}:not_a_module", input_shape=(4,), num_classes=5)
    with pytest.raises(TaskError, match="cannot import module"):
        build_model("no_such_module_xyz:net", input_shape=(4,), num_classes=5)


def _identity_classifier() -> nn.Linear:
    model = nn.Linear(2, 2)
    with torch.no_grad():
        model.weight.copy_(torch.eye(2))
        model.bias.zero_()
    return model


@pytest.mark.parametrize("batch_size", [1, 3, 1024])
def test_evaluate_hand_computed(batch_size: int) -> None:
    model = _identity_classifier()
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 2.0]])
    y = torch.tensor([0, 1, 1, 1])
    result = evaluate(model, x, y, make_loss("cross_entropy"), batch_size=batch_size)
    # predictions 0, 1, 0, 1: three of four right
    assert result["accuracy"] == 0.75
    # cross entropy of logits (a, b) for the right class: log(1 + exp(other - right))
    expected = (2 * math.log1p(math.exp(-1)) + math.log1p(math.exp(1)) + math.log1p(math.exp(-2))) / 4
    assert result["loss"] == pytest.approx(expected, rel=1e-6)


def test_evaluate_restores_training_mode() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.9))
    seen: list[bool] = []
    model.register_forward_hook(lambda module, args, out: seen.append(module.training))
    x, y = torch.zeros(3, 2), torch.zeros(3, dtype=torch.int64)
    model.train()
    evaluate(model, x, y, make_loss("cross_entropy"))
    assert seen == [False] and model.training and model[1].training
    model.eval()
    evaluate(model, x, y, make_loss("cross_entropy"))
    assert not model.training
    with pytest.raises(TaskError, match="no examples"):
        evaluate(model, x[:0], y[:0], make_loss("cross_entropy"))


def test_make_loss() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5], [0.0, 0.0, 3.0]])
    target = torch.tensor([1, 2])
    ce = make_loss("cross_entropy")(logits, target)
    nll = make_loss("nll")(torch.log_softmax(logits, dim=1), target)
    assert float(ce) == pytest.approx(float(nll))
    manual = -(torch.log_softmax(logits, 1)[0, 1] + torch.log_softmax(logits, 1)[1, 2]) / 2
    assert float(ce) == pytest.approx(float(manual))
    with pytest.raises(
        TaskError, match="loss 'mse' is not a loss of kind classification; valid: cross_entropy, nll, bce or package"
    ):
        make_loss("mse")


def test_bce_is_each_logit_against_the_one_hot_label() -> None:
    logits = torch.tensor([[2.0, -1.0], [0.0, 3.0]])
    target = torch.tensor([1, 1])
    sig = torch.sigmoid(logits)
    # one-hot targets [[0, 1], [0, 1]]: -mean of log(1 - p) where the target is 0, log(p) where it is 1
    manual = -(torch.log(1 - sig[0, 0]) + torch.log(sig[0, 1]) + torch.log(1 - sig[1, 0]) + torch.log(sig[1, 1])) / 4
    assert float(make_loss("bce")(logits, target)) == pytest.approx(float(manual))


def test_a_loss_by_import_path_trains(user_module: Callable[[str], str], tmp_path: Path) -> None:
    """Half the cross-entropy at twice the learning rate takes SGD's very steps: same model, half the loss."""
    from conftest import run_to_end

    name = user_module(
        """
        from torch.nn import functional as F

        def half_ce(outputs, labels):
            return 0.5 * F.cross_entropy(outputs, labels)
        """
    )
    params, records = run_to_end(tmp_path / "ce", "rounds=2", "local.lr=0.05")
    half_params, half_records = run_to_end(tmp_path / "half", "rounds=2", "local.lr=0.1", f"task.loss={name}:half_ce")
    for key in params:
        torch.testing.assert_close(half_params[key], params[key], rtol=1e-5, atol=1e-6)
    for full, half in zip(records, half_records):
        assert half["train_loss"] == pytest.approx(full["train_loss"] / 2, rel=1e-4)
        assert half["test_accuracy"] == full["test_accuracy"]


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny models train faster on one intra-op thread; on a busy machine, several wait on each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_thread")
def test_mlp_learns_synthetic_data() -> None:
    data = load_dataset("synthetic", seed=0, options={"samples": 500})
    model = build_model(
        "mlp", input_shape=data.input_shape, num_classes=data.num_classes, options={"hidden": [32]}, seed=0
    )
    loss_fn = make_loss("cross_entropy")
    before = evaluate(model, data.x_test, data.y_test, loss_fn)
    # full-batch gradient descent by hand: torch.optim's first use imports torch._dynamo (seconds)
    for _ in range(60):
        model.zero_grad()
        loss_fn(model(data.x_train), data.y_train).backward()
        with torch.no_grad():
            for param in model.parameters():
                param -= 0.5 * param.grad
    after = evaluate(model, data.x_test, data.y_test, loss_fn)
    assert before["accuracy"] < 0.3 and after["accuracy"] > 0.9 and after["loss"] < before["loss"]


def test_a_model_too_large_to_allocate_is_a_task_error_naming_it() -> None:
    with pytest.raises(TaskError) as refused:
        build_model("mlp", input_shape=(8,), num_classes=4, options={"hidden": [10**14]}, seed=0)
    assert str(refused.value) == (
        "task.model 'mlp' with task.model_options {'hidden': [100000000000000]} does not fit in memory "
        f"(it tried to allocate {8 * 10**14 * 4 / 2**30:.1f} GiB); choose a smaller model"
    )


def test_other_runtime_errors_of_a_factory_are_not_called_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(**_: object) -> nn.Module:
        raise RuntimeError("a bug in the factory")

    monkeypatch.setattr("fedweave.task.models.load_callable", lambda spec, what: broken)
    with pytest.raises(RuntimeError, match="^a bug in the factory$"):
        build_model("mine:factory", input_shape=(8,), num_classes=4)

    def exhausted(**_: object) -> nn.Module:
        raise MemoryError

    monkeypatch.setattr("fedweave.task.models.load_callable", lambda spec, what: exhausted)
    with pytest.raises(TaskError, match=r"^task.model 'mine:factory' with task.model_options \{\} does not fit in memory \(out of memory\)"):
        build_model("mine:factory", input_shape=(8,), num_classes=4)
