"""The parameter server of the asynchronous mode (``data_parallel.sync: asp``): the model,
its optimiser and version, and the ranges of the sampler it hands out (no I/O, no clocks;
the processes and messages around it: :mod:`fedweave.data_parallel.asp`).

OmniLearn's ASP: Tyagi & Sharma, "OmniLearn: A Framework for Distributed Deep Learning
over Heterogeneous Clusters", IEEE TPDS 2025, https://arxiv.org/abs/2503.17469.
Staleness weights as in FedAsync (Xie et al., https://arxiv.org/abs/1903.03934) and
FedBuff (Nguyen et al., AISTATS 2022, https://arxiv.org/abs/2106.06639).

No worker waits for another. The server holds the model, its optimiser and a version
(server steps taken); each worker loops::

    receive  the params of version v and a range of the global sampler: b_i samples
    compute  g = ∇ mean loss over its b_i samples          timed: compute time t_i
    push     [header: v, t_i, wait, loss | g | Δ float buffers]     one flat message

and the server, for each push in the order they arrive::

    τ    = version − v                                     staleness, in server steps
    drop   the push when τ > max_staleness
    acc += (b_i / B) · s(τ) · g                            s: FedBuff's, e.g. polynomial (1+τ)^-½
    every K (``buffer``) kept pushes: p.grad = acc; optimizer.step(); version += 1
    controller.observe({i: b_i}, {i: t_i}); reply to i: current params, its next range

- **Weights.** B is ``global_batch`` and the controller's b_i sum to it, so one fresh
  push from each worker moves the model as one synchronous step of B samples would
  (the gradient is weighted by b_i / B there too): ``lr`` means the same in bsp and
  asp. With one worker, asp *is* single-process SGD (tested). The weights scale the
  gradient, not the learning rate, so SGD's momentum sees weighted gradients; Adam,
  which normalises the scale away, is refused with asp when the config is loaded.
- **Even update rates (OmniLearn).** The dynamic controller gives b_i = B · X_i / Σ X_j
  (X_i: measured throughput, each push one measurement), so every worker's update
  takes B / Σ X_j and the workers push at the same rate. With static equal batches a
  worker pushes in proportion to its speed, and the slow worker's gradients are
  always the stalest: at speeds 1:2:4 its updates are ~6 server steps old against
  ~0.75 for the fast one. (The mean over *all* updates is W − 1 in both cases: each
  update is as old as the number of updates the others applied while it computed.
  Balancing evens staleness out across workers; it does not lower its mean.)
- **The sampler.** The server hands out consecutive ranges of the epoch's seeded
  permutation (:class:`~fedweave.data_parallel.sampler.GlobalSampler`), so an epoch covers
  each sample once; a worker computes the permutation of the range's epoch itself.
  An epoch is complete when all its samples' pushes have arrived (applied or
  dropped); evaluation and checkpoints happen then. A range held by a worker that is
  lost is handed out again, first thing, to the next worker that asks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fedweave.data_parallel.sampler import GlobalSampler
from fedweave.federated.buffered import staleness_weight
from fedweave.config import StalenessOptions
from fedweave.data_parallel.gradients import assign_gradient, copy_flat, float_buffers, trainable
from fedweave.data_parallel.records import load_optimizer_state, optimizer_state
from fedweave.training import LocalOptimizer


def update_weight(batch: int, global_batch: int, staleness: int, settings: StalenessOptions) -> float:
    """(b_i / B) · s(τ): the weight of a pushed mean gradient over ``batch`` samples, with
    FedBuff's staleness functions (:func:`fedweave.federated.buffered.staleness_weight`)."""
    return batch / global_batch * staleness_weight(staleness, settings)


@dataclass(frozen=True)
class Arrival:
    """What the server did with one push."""

    staleness: int
    weight: float | None  # None: dropped, older than max_staleness
    stepped: bool  # the push filled the buffer: the server took a step


class ParameterServer:
    """The model, its optimiser and version: pushed gradients in, steps out (no I/O, no clocks)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: LocalOptimizer,
        global_batch: int,
        staleness: StalenessOptions | None = None,
        buffer: int = 1,
    ):
        self.model = model
        self.optimizer = optimizer
        self.params = trainable(model)
        self.buffers = float_buffers(model)
        self.global_batch = global_batch
        self.staleness = staleness or StalenessOptions()
        self.buffer = buffer
        self.dtype = self.params[0].dtype
        self.num_params = sum(p.numel() for p in self.params)
        self.num_buffers = sum(b.numel() for b in self.buffers)
        self.version = 0  # server steps taken
        self.pending = 0  # pushes summed into the buffer since the last step
        self._grad = torch.zeros(self.num_params, dtype=self.dtype)
        self._delta = torch.zeros(self.num_buffers, dtype=self.dtype)

    def receive(self, gradient: torch.Tensor, buffer_delta: torch.Tensor, batch: int, pulled: int) -> Arrival:
        """One push: the mean gradient over ``batch`` samples (and the change of the float
        buffers) computed on version ``pulled``. Steps when the buffer is full."""
        tau = self.version - pulled
        if tau < 0:
            raise ValueError(f"a push computed on version {pulled}, ahead of the server's {self.version}")
        limit = self.staleness.max_staleness
        if limit is not None and tau > limit:
            return Arrival(tau, None, False)
        weight = update_weight(batch, self.global_batch, tau, self.staleness)
        self._grad.add_(gradient.to(self.dtype), alpha=weight)
        if self.num_buffers:
            self._delta.add_(buffer_delta.to(self.dtype), alpha=weight)
        self.pending += 1
        if self.pending < self.buffer:
            return Arrival(tau, weight, False)
        self.step()
        return Arrival(tau, weight, True)

    def step(self) -> bool:
        """Apply the buffered sum (also a partly filled buffer, at the end); False if empty."""
        if not self.pending:
            return False
        assign_gradient(self.model, self._grad)
        self.optimizer.step()
        copy_flat(self.buffers, self._delta, add=True)
        self._grad.zero_()
        self._delta.zero_()
        self.pending = 0
        self.version += 1
        return True

    def flat(self) -> torch.Tensor:
        """Trainable params, then float buffers, as one flat vector: what a worker pulls."""
        return torch.cat([t.detach().reshape(-1).to(self.dtype) for t in (*self.params, *self.buffers)])

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "pending": self.pending,
            "grad": self._grad.clone(),
            "delta": self._delta.clone(),
            "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "optimizer": optimizer_state(self.optimizer),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.version = int(state["version"])
        self.pending = int(state["pending"])
        self._grad.copy_(state["grad"])
        self._delta.copy_(state["delta"])
        self.model.load_state_dict(state["model"])
        load_optimizer_state(self.optimizer, state["optimizer"], self.params[0].device)


@dataclass(frozen=True)
class Assignment:
    """A range of the sampler: ``count`` positions from ``start`` of epoch ``epoch``'s permutation."""

    epoch: int
    start: int
    count: int


class Ranges:
    """Hands out disjoint ranges of the global sampler; lost ranges are handed out again first.

    ``epochs`` None: endless (a run bounded by steps).
    """

    def __init__(self, sampler: GlobalSampler, epochs: int | None):
        self.sampler = sampler
        self.epochs = epochs
        self.orphans: deque[Assignment] = deque()
        self.completed = 0  # epochs whose every sample was resolved
        self.partial: dict[int, int] = {}  # epoch -> samples resolved, for epochs not complete

    @property
    def exhausted(self) -> bool:
        """Every range of the run was handed out (and none is waiting to be handed out again)."""
        return self.epochs is not None and self.sampler.epoch >= self.epochs and not self.orphans

    def next(self, size: int) -> Assignment | None:
        """The next range of at most ``size`` positions (None: nothing left to hand out)."""
        if self.orphans:
            a = self.orphans.popleft()
            if a.count > size:
                self.orphans.appendleft(Assignment(a.epoch, a.start + size, a.count - size))
                a = Assignment(a.epoch, a.start, size)
            return a
        if self.epochs is not None and self.sampler.epoch >= self.epochs:
            return None
        a = Assignment(self.sampler.epoch, self.sampler.offset, self.sampler.step_size(size))
        self.sampler.advance(a.count)
        return a

    def resolve(self, a: Assignment) -> bool:
        """``a``'s push arrived; True when that completes its epoch."""
        done = self.partial.get(a.epoch, 0) + a.count
        if done < self.sampler.num_samples:
            self.partial[a.epoch] = done
            return False
        self.partial.pop(a.epoch, None)
        self.completed += 1
        return True

    @property
    def progress(self) -> float:
        """Epochs of samples resolved (fractional)."""
        return self.completed + sum(self.partial.values()) / self.sampler.num_samples

    def state_dict(self, outstanding: Sequence[Assignment]) -> dict[str, Any]:
        """The state, with the ranges in flight (``outstanding``) to be handed out again on resume."""
        return {
            "sampler": self.sampler.state_dict(),
            "orphans": [(a.epoch, a.start, a.count) for a in [*outstanding, *self.orphans]],
            "completed": self.completed,
            "partial": dict(self.partial),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.orphans = deque(Assignment(*map(int, a)) for a in state["orphans"])
        self.completed = int(state["completed"])
        self.partial = {int(e): int(c) for e, c in state["partial"].items()}
