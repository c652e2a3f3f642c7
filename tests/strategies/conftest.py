"""Tiny, hand-checkable client jobs for strategy tests."""

from __future__ import annotations

import torch
from torch import nn

from fedweave.training import ClientJob, LocalSettings
from fedweave.types import Instruction, Params, TaskKind, Work


class Tiny(nn.Module):
    """``features``: Linear(2→2) without bias; ``head``: Linear(2→1). Seven numbers in all."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Linear(2, 2, bias=False)
        self.head = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def tiny_params(scale: float = 1.0) -> Params:
    """Fixed parameters of :class:`Tiny`, in float64 so hand computations match to 1e-12."""
    return {
        "features.weight": torch.tensor([[1.0, 0.5], [-0.5, 1.0]], dtype=torch.float64) * scale,
        "head.weight": torch.tensor([[0.25, -0.75]], dtype=torch.float64) * scale,
        "head.bias": torch.tensor([0.1], dtype=torch.float64) * scale,
    }


def tiny_data() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.tensor([[1.0, 2.0], [0.0, -1.0], [3.0, 1.0], [-2.0, 0.5]], dtype=torch.float64)
    y = torch.tensor([[1.0], [0.0], [2.0], [-1.0]], dtype=torch.float64)
    return x, y


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def tiny_job(
    params: Params | None = None,
    *,
    client_id: int = 0,
    rnd: int = 1,
    batch_size: int = 4,
    epochs: int = 1,
    local_steps: int | None = None,
    lr: float = 0.1,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    optimizer: str = "sgd",
    config: dict | None = None,
    extras: Params | None = None,
    state: dict | None = None,
    task: TaskKind = TaskKind.TRAIN,
) -> ClientJob:
    """A client job on :class:`Tiny` with the 4 fixed samples of :func:`tiny_data`.

    With the default ``batch_size=4`` every step is full-batch gradient descent, so a
    test can compute the expected result by hand (or with autograd on the same maths).
    """
    params = tiny_params() if params is None else params
    model = Tiny().double()
    model.load_state_dict(params)
    x, y = tiny_data()
    instruction = Instruction(
        round=rnd,
        task=task,
        work=Work(client_id, batch_size, epochs, local_steps),
        params=params,
        config=dict(config or {}),
        extras=dict(extras or {}),
    )
    return ClientJob(
        client_id=client_id,
        instruction=instruction,
        model=model,
        x_train=x,
        y_train=y,
        x_test=x,
        y_test=y,
        loss_fn=mse,
        settings=LocalSettings(optimizer=optimizer, lr=lr, momentum=momentum, weight_decay=weight_decay),
        generator=torch.Generator().manual_seed(0),
        state=dict(state or {}),
    )
