"""The fast path for chains of Linear layers: which models it takes, and each client's own gradient."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from fedweave.cohort.layered import ChainGradients, autograd_loss_grad, cross_entropy_grad, task_losses, trace_chain
from fedweave.task.models import MLP


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.a(x)


def test_the_mlp_is_a_chain_and_other_models_are_not() -> None:
    layers = trace_chain(MLP((2, 3), 5, hidden=(8,)), torch.zeros(2, 3))
    assert [(layer.kind, layer.name, layer.bias) for layer in layers] == [
        ("flatten", "", False), ("linear", "features.1", True), ("activation", "", False), ("linear", "head", True)
    ]
    assert trace_chain(MLP((2, 3), 5, dropout=0.1), torch.zeros(2, 3)) is None  # dropout
    assert trace_chain(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), torch.zeros(4)) is None  # buffers
    assert trace_chain(Residual(), torch.zeros(4)) is None  # not a chain
    assert trace_chain(nn.Sequential(nn.Linear(3, 2)), torch.zeros(2, 3)) is None  # a Linear fed unflattened rows
    assert trace_chain(nn.Sequential(nn.Flatten(2), nn.Linear(6, 2)), torch.zeros(1, 2, 3)) is None


@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
def test_each_client_gets_its_own_gradient_and_padding_counts_for_nothing(loss: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(  # each activation after a Linear, and some after the input or another activation
        nn.Flatten(), nn.ReLU(), nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 4), nn.GELU(), nn.Linear(4, 4, bias=False),
        nn.LeakyReLU(0.1), nn.Linear(4, 3), nn.SiLU(), nn.Linear(3, 4), nn.ReLU(), nn.Sigmoid(), nn.Linear(4, 4),
        nn.Sigmoid(), nn.Tanh(), nn.Linear(4, 3),
    )
    layers = trace_chain(model, torch.zeros(2, 3))
    K, B = 3, 4
    clients = [{k: v + 0.1 * torch.randn_like(v) for k, v in model.state_dict().items()} for _ in range(K)]
    params = {name: torch.stack([c[name] for c in clients]) for name in clients[0]}
    x = torch.randn(K, B, 2, 3)
    counts = [4, 2, 3]  # real rows of each client's batch, padding after them
    real = (torch.arange(B) < torch.tensor(counts).unsqueeze(1)).float()
    if loss == "cross_entropy":
        y = torch.randint(0, 3, (K, B))
        loss_grad, own = cross_entropy_grad(), nn.functional.cross_entropy
    else:
        y = torch.randn(K, B, 3)
        loss_grad = autograd_loss_grad(lambda out, t: ((out - t) ** 2).mean(1))
        own = nn.functional.mse_loss
    given = x.clone()
    weight = (real / real.sum(1, keepdim=True)).unsqueeze(1)
    losses = torch.full((K, 1, B), float("nan"))  # every row's written, padding's too (weight 0 then)
    grads = ChainGradients(layers, params, loss_grad)(x, y, weight, losses)
    task = task_losses(losses, weight)
    assert torch.equal(x, given)  # the batch is read, never overwritten (an activation in place takes a Linear's output)
    for k in range(K):
        model.load_state_dict(clients[k])
        model.zero_grad()
        value = own(model(x[k, : counts[k]]), y[k, : counts[k]])
        value.backward()
        assert task[k].item() == pytest.approx(value.item(), rel=1e-6)
        for name, p in model.named_parameters():
            torch.testing.assert_close(grads[name][k], p.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_client_s_gradients_in_a_group_are_its_gradients_alone_bit_for_bit(threads: int) -> None:
    """Input and hidden widths multiples of 8, any head, batches padded to multiples of 8: each
    client's gradients have the same bits at any place in a group of any size as alone."""
    rng = random.Random(0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for _ in range(12):
            features, hidden = rng.choice([8, 64, 784]), rng.choice([[8], [128], [64, 32]])
            outputs, B, K = rng.choice([1, 2, 10]), rng.choice([8, 16, 40]), rng.choice([2, 3, 5])
            widths = [features, *hidden]
            model = nn.Sequential(*[m for a, b in zip(widths, widths[1:]) for m in (nn.Linear(a, b), nn.ReLU())],
                                  nn.Linear(widths[-1], outputs))
            layers = trace_chain(model, torch.zeros(features))
            params = {name: torch.randn(K, *p.shape) for name, p in model.named_parameters()}
            x, weight = torch.randn(K, B, features), torch.rand(K, 1, B)
            if outputs > 1:
                y, loss_grad = torch.randint(0, outputs, (K, B)), cross_entropy_grad()
            else:
                y, loss_grad = torch.randn(K, B, 1), autograd_loss_grad(lambda out, t: ((out - t) ** 2).mean(1))
            group = ChainGradients(layers, params, loss_grad)(x, y, weight, torch.zeros(K, 1, B))
            group = {name: g.clone() for name, g in group.items()}
            for k in range(K):
                alone = ChainGradients(layers, {n: p[k : k + 1].clone() for n, p in params.items()}, loss_grad)(
                    x[k : k + 1], y[k : k + 1], weight[k : k + 1], torch.zeros(1, 1, B)
                )
                assert all(torch.equal(group[name][k], alone[name][0]) for name in group), (widths, outputs, B, K, k)
    finally:
        torch.set_num_threads(before)
