"""What a data-parallel run records: its directory and saved state, the metrics window,
evaluations, the checkpoint and model files, and the optimiser's state within them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedweave import rundir
from fedweave.checkpoint import checkpoint_type, save_state
from fedweave.config import Config
from fedweave.observe.metrics import read_metrics
from fedweave.training import LocalOptimizer, LossFn
from fedweave.task import Dataset, evaluate

PLOT_FILE = "workers.png"

Record = dict[str, Any]


@dataclass
class DataParallelRun:
    """A prepared data-parallel run: its config, directory and where it starts."""

    config: Config
    run_dir: Path
    resume_state: dict[str, Any] | None = None
    records: list[Record] = field(default_factory=list)

    @property
    def start_step(self) -> int:
        return 0 if self.resume_state is None else int(self.resume_state["step"])

    @property
    def finished(self) -> bool:
        """Whether the saved state already completed the configured steps or epochs. An asp
        state counts the epochs whose every sample was resolved: its sampler may be past
        the last epoch while ranges handed out earlier are still to be trained."""
        if self.resume_state is None:
            return False
        dp = self.config.data_parallel
        if dp.steps is not None:
            return self.start_step >= dp.steps
        if self.resume_state.get("sync") == "asp":
            return int(self.resume_state["completed"]) >= dp.epochs
        return int(self.resume_state["sampler"]["epoch"]) >= dp.epochs


@checkpoint_type
@dataclass
class Window:
    """Per-worker sums over the steps since the last metrics line (identical on every worker)."""

    steps: int = 0
    samples: int = 0
    loss: float = 0.0
    taken: dict[int, int] = field(default_factory=dict)  # steps each worker took part in
    batch: dict[int, float] = field(default_factory=dict)
    compute: dict[int, float] = field(default_factory=dict)
    idle: dict[int, float] = field(default_factory=dict)
    comm: float = 0.0
    comm_steps: int = 0
    step_time: float = 0.0  # this worker's wall time per step (rank 0's is what is logged)
    controller_time: float = 0.0
    skipped: int = 0  # steps whose gradient was refused: no update, no loss counted
    skipped_samples: int = 0

    def add(
        self, sizes: Mapping[int, int], times: Mapping[int, float], loss: float, comm: float | None,
        skipped: bool = False,
    ) -> None:
        self.steps += 1
        total = sum(sizes.values())
        self.samples += total
        if skipped:
            self.skipped += 1
            self.skipped_samples += total
        else:
            self.loss += loss * total
        slowest = max(times.values())
        for w in sizes:
            self.taken[w] = self.taken.get(w, 0) + 1
            self.batch[w] = self.batch.get(w, 0.0) + sizes[w]
            self.compute[w] = self.compute.get(w, 0.0) + times[w]
            self.idle[w] = self.idle.get(w, 0.0) + slowest - times[w]
        if comm is not None:
            self.comm += comm
            self.comm_steps += 1


# checkpoints written before the package split pickled the window under its old path
torch.serialization.add_safe_globals([(Window, "fedweave.data_parallel._Window")])

def evaluation(config: Config, model: nn.Module, dataset: Dataset, loss_fn: LossFn) -> Record:
    """``model``'s metrics on the test set, each named ``test_<metric>`` as in a metrics line."""
    metrics = evaluate(model, dataset.x_test, dataset.y_test, loss_fn, batch_size=config.eval.batch_size)
    return {f"test_{name}": value for name, value in metrics.items()}


def save_checkpoint(run_dir: Path, step: int, state: dict[str, Any]) -> None:
    """The run's checkpoint after ``step``: ``state`` is what the run resumes from."""
    save_state(run_dir, {"mode": "data_parallel", "round": step, "state": state})


def save_model(model: nn.Module, run_dir: Path) -> None:
    """The trained model's state (on the CPU) in ``run_dir``."""
    rundir.save_model({k: v.detach().cpu() for k, v in model.state_dict().items()}, run_dir)


def optimizer_state(optimizer: LocalOptimizer) -> dict[str, Any]:
    """The optimiser's state for a checkpoint (its tensors copied to the CPU)."""
    return {"steps": optimizer.steps, "state": _to(optimizer.state, torch.device("cpu"))}


def load_optimizer_state(optimizer: LocalOptimizer, saved: Mapping[str, Any], device: torch.device) -> None:
    """Restore what :func:`optimizer_state` saved, its tensors on ``device``."""
    optimizer.steps = int(saved["steps"])
    optimizer.state = _to(saved["state"], device)


def _to(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().to(device).clone()
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to(v, device) for v in obj]
    return obj


def last_logged_step(path: Path) -> int:
    records = read_metrics(path)
    return int(records[-1]["step"]) if records else -1
