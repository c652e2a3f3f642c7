"""One group trained by :func:`fedweave.cohort.vectorised.train_group` against each client's own loop."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedweave.cohort.vectorised import steps_of, train_group
from fedweave.task.models import make_loss
from fedweave.training import SGD_LOOP, ClientJob, Hooks, LocalSettings, LocalStep
from fedweave.types import Instruction, TaskKind, Work


class Residual(nn.Module):
    """Not a chain of Linear layers: trained through ``vmap``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.head = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + torch.relu(self.a(x)))


def jobs(model: nn.Module, sizes: list[int], ignored: list[list[int]]) -> list[ClientJob]:
    """A job per size, rows of 8 features, labels 0..2 except those at ``ignored`` (-100)."""
    out = []
    start = {k: v.clone() for k, v in model.state_dict().items()}
    for k, (n, skip) in enumerate(zip(sizes, ignored)):
        g = torch.Generator().manual_seed(k)
        y = torch.randint(0, 3, (n,), generator=g)
        y[skip] = -100
        out.append(ClientJob(
            client_id=k, instruction=Instruction(1, TaskKind.TRAIN, Work(k, 4, epochs=2), start), model=model,
            x_train=torch.randn(n, 8, generator=g), y_train=y, x_test=torch.zeros(0, 8),
            y_test=torch.zeros(0, dtype=torch.long), loss_fn=make_loss("cross_entropy"),
            settings=LocalSettings(optimizer="sgd", lr=0.1, momentum=0.9, weight_decay=0.0),
            generator=torch.Generator().manual_seed(100 + k),
        ))
    return out


@pytest.mark.parametrize("model", [nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)), Residual()],
                         ids=["chain", "vmap"])
def test_targets_the_loss_ignores_count_for_nothing_as_in_the_loop(model: nn.Module) -> None:
    """Cross-entropy's mean is over the targets it does not ignore (``ignore_index``), in a cohort
    as in the loop: a batch with an ignored target steps as if it were one row shorter."""
    torch.manual_seed(0)
    sizes, ignored = [7, 5, 9], [[1], [0, 3], [2, 8]]
    trained = train_group(model, make_loss("cross_entropy"), cohort := jobs(model, sizes, ignored),
                          [LocalStep() for _ in cohort], 8)
    for job, delta, result in zip(jobs(model, sizes, ignored), trained.deltas, trained.results):
        model.load_state_dict(job.instruction.params)
        own = SGD_LOOP.train(job, Hooks())
        assert result.steps == own.steps == steps_of(job)
        for name, value in model.state_dict().items():
            torch.testing.assert_close(job.instruction.params[name] + delta[name], value, rtol=1e-5, atol=1e-6)
