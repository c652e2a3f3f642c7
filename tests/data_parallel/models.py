"""Models of the data-parallel tests that worker processes build by name (``task.model``)."""

from __future__ import annotations

import torch
from torch import nn

from fedweave.task import build_model


class Float64(nn.Module):
    """``inner`` in float64, on float32 inputs."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.double())


def mlp64(input_shape: tuple[int, ...], num_classes: int, hidden: list[int]) -> nn.Module:
    """The built-in MLP in float64 (exact comparisons across processes)."""
    return Float64(build_model("mlp", input_shape=input_shape, num_classes=num_classes, options={"hidden": hidden}))


def input_bn_mlp64(input_shape: tuple[int, ...], num_classes: int, hidden: list[int]) -> nn.Module:
    """Batch normalisation of the inputs before :func:`mlp64`'s MLP: its running statistics depend on
    each worker's samples only, not on the parameters, so a test can follow them by hand."""
    mlp = build_model("mlp", input_shape=input_shape, num_classes=num_classes, options={"hidden": hidden})
    return Float64(nn.Sequential(nn.BatchNorm1d(input_shape[0]), mlp))
