"""Local training: the one seam through which a client's round of local work runs.

:class:`LocalTraining` is a small protocol: ``train(job, hooks)`` runs the round's local work
(``instruction.work``) and returns its :class:`TrainResult`; ``report()`` says what it spent
beyond the update (DP-SGD: its sampling rate and steps, for the server's privacy ledger).
:data:`SGD_LOOP` is the plain loop every algorithm reuses. A wrapper takes the loop over for a
round: a client-side plugin with :class:`~fedweave.plugins.contracts.TakesOverTraining` gives the
client runtime the round's training (DP-SGD, :mod:`fedweave.plugins.privacy.dpsgd`; LoRA next),
which the job carries (``ClientJob.training``). Strategies reach whichever runs through
:func:`train_local`, and change it through its :class:`Hooks` instead of copying it:

- ``loss``: ``(model, x, y) -> (loss to minimise, task loss to report)``; FedProx adds
  its proximal term here, MOON its contrastive term;
- ``after_backward``: called with the model after ``loss.backward()`` and before the
  optimiser step; SCAFFOLD corrects gradients here;
- ``model`` (Ditto's personal one) and ``optimizer`` (DiLoCo's inner AdamW).

What an instruction may change of a client's local training, per round, is the ``local``
section's keys but the site's device (:data:`INSTRUCTED`), each checked as the config checks it
(:func:`instructed`): a strategy that sets ``epochs`` for a round gets that many epochs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol
from collections.abc import Callable

import torch
from torch import nn

from fedweave.config.sections import LocalConfig
from fedweave.schema import checked
from fedweave.types import Instruction, Params, Update, UpdateKind, Work

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Penalty = Callable[[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]], torch.Tensor]
LossHook = Callable[[nn.Module, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
AfterBackward = Callable[[nn.Module], None]


@dataclass(frozen=True)
class LocalSettings:
    """The optimiser settings of one client's local training (config ``local``, possibly
    changed per round by the instruction's ``config``: :func:`instructed`)."""

    optimizer: Literal["sgd", "adam", "adamw"]  # adamw: DiLoCo's inner optimiser, its own step
    lr: float
    momentum: float
    weight_decay: float


INSTRUCTED = ("epochs", "steps", "batch_size", "optimizer", "lr", "momentum", "weight_decay")
"""The keys of an instruction's ``config`` that change the client's local training for the round:
the ``local`` section's, named as there, but ``device`` (the site's own). ``steps`` overrides
``epochs`` as in the config, and ``epochs`` alone sets the round's epochs even where the
controller assigned steps."""


def instructed(settings: LocalSettings, work: Work, config: Mapping[str, Any]) -> tuple[LocalSettings, Work]:
    """The round's settings and work with the :data:`INSTRUCTED` keys of ``config`` applied, each
    checked as ``local.<key>`` is when the config loads (a ConfigError naming the key otherwise);
    other keys are the caller's to check."""
    given = {k: checked(LocalConfig, k, config[k], k) for k in INSTRUCTED if k in config}
    if not given:
        return settings, work
    own = {k: given[k] for k in ("optimizer", "lr", "momentum", "weight_decay") if k in given}
    if "epochs" in given:
        work = replace(work, epochs=given["epochs"], local_steps=None)
    if "steps" in given:
        work = replace(work, local_steps=given["steps"])
    if "batch_size" in given:
        work = replace(work, batch_size=given["batch_size"])
    return (replace(settings, **own) if own else settings), work


@dataclass
class TrainResult:
    steps: int
    num_examples: int
    mean_loss: float


@dataclass(frozen=True)
class Hooks:
    """What a strategy's client half changes of a round's training: ``model`` (default
    ``job.model``; Ditto trains a second, personal model), ``optimizer`` (default a
    :class:`LocalOptimizer` of ``job.settings``), ``loss`` and ``after_backward`` (module doc)."""

    model: nn.Module | None = None
    optimizer: LocalOptimizer | None = None
    loss: LossHook | None = None
    after_backward: AfterBackward | None = None


@dataclass(frozen=True)
class LocalStep:
    """The math a client half adds to a plain local step, declared rather than written into a loop,
    so that the sequential loop (:meth:`hooks`) and the vectorised cohort (:mod:`fedweave.cohort`)
    compute the same step:

    - ``penalty(params, anchor)``: added to the task loss, a pure function of the trainable
      parameters by name and of ``anchor`` (FedProx: μ/2·‖w − w_global‖²); the same function
      for every client of a strategy, ``anchor`` the client's own;
    - ``correction``: added to each trainable parameter's gradient after the backward pass, before
      the optimiser step (SCAFFOLD's c − c_i).
    """

    penalty: Penalty | None = None
    anchor: Params | None = None
    correction: Params | None = None

    def hooks(self, model: nn.Module, loss_fn: LossFn) -> dict[str, Any]:
        """The :func:`train_local` hooks of this step for ``model``."""
        hooks: dict[str, Any] = {}
        penalty, anchor, correction = self.penalty, self.anchor, self.correction
        if penalty is not None:
            trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}

            def loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                task = loss_fn(m(x), y)
                return task + penalty(trainable, anchor or {}), task

            hooks["loss"] = loss
        if correction is not None:
            named = [(p, correction[name]) for name, p in model.named_parameters() if p.requires_grad]

            def correct(_: nn.Module) -> None:
                for p, c in named:
                    if p.grad is not None:
                        p.grad.add_(c)

            hooks["after_backward"] = correct
        return hooks


PLAIN_STEP = LocalStep()
"""A plain local step: the task loss, its gradient, the optimiser."""


class LocalTraining(Protocol):
    """One round of a client's local training: the plain loop (:data:`SGD_LOOP`) or a wrapper
    that takes it over."""

    def train(self, job: ClientJob, hooks: Hooks) -> TrainResult: ...

    def report(self) -> dict[str, float]:
        """What the round's training spent, sent with the update beyond its own metrics (may be empty)."""
        ...


@dataclass
class ClientJob:
    """Everything the client half of a strategy gets for one round."""

    client_id: int
    instruction: Instruction
    model: nn.Module  # already holds instruction.params
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    loss_fn: LossFn
    settings: LocalSettings
    generator: torch.Generator  # seeded for this (round, client): shuffling and sampling
    state: dict[str, Any] = field(default_factory=dict)  # kept per client across rounds
    training: LocalTraining = field(default_factory=lambda: SGD_LOOP)  # the round's: the loop, or a wrapper's


class LocalOptimizer:
    """SGD (momentum, weight decay) or Adam, computing exactly what ``torch.optim.SGD`` /
    ``torch.optim.Adam`` compute with their default flags.

    Written out because the first ``torch.optim`` optimiser of a process imports
    ``torch._dynamo``, which costs seconds of start-up for a run that trains tiny
    models in a few hundred milliseconds.
    """

    def __init__(self, params: Any, settings: LocalSettings):
        self.params = [p for p in params if p.requires_grad]
        self.settings = settings
        self.steps = 0
        self.state: list[dict[str, Any]] = [{} for _ in self.params]

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        s = self.settings
        self.steps += 1
        for p, state in zip(self.params, self.state):
            if p.grad is None:
                continue
            g = p.grad
            if s.weight_decay:
                g = g.add(p, alpha=s.weight_decay)
            if s.optimizer == "sgd":
                if s.momentum:
                    buf = state.get("momentum")
                    if buf is None:
                        buf = state["momentum"] = g.detach().clone()
                    else:
                        buf.mul_(s.momentum).add_(g)
                    g = buf
                p.add_(g, alpha=-s.lr)
            else:
                beta1, beta2, eps = 0.9, 0.999, 1e-8
                if not state:
                    state["step"] = 0
                    state["m"] = torch.zeros_like(p)
                    state["v"] = torch.zeros_like(p)
                # Counted per parameter, as torch.optim.Adam does: a step without a
                # gradient for p (p.grad is None) does not advance p's bias correction.
                state["step"] += 1
                m, v = state["m"], state["v"]
                m.lerp_(g, 1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                bias1 = 1 - beta1 ** state["step"]
                bias2 = 1 - beta2 ** state["step"]
                denom = (v.sqrt() / bias2**0.5).add_(eps)
                p.addcdiv_(m, denom, value=-s.lr / bias1)


def rows(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``tensor[index]`` for ``index`` row numbers that are non-negative (a permutation's, a
    partition's; the caller's promise, not checked): the same contiguous copy, by ``index_select``
    when ``index`` is 1-D int64 on ``tensor``'s device, which skips advanced indexing's set-up
    (a 32-row MNIST batch 11 -> 4 µs, a client's 400 rows 123 -> 88 µs on one CPU thread)."""
    if index.dtype == torch.int64 and index.dim() == 1 and index.device == tensor.device and tensor.dim() > 0:
        return tensor.index_select(0, index)
    return tensor[index]


@dataclass
class Opening:
    """What every round of local training starts from: the model to train, its optimiser, and
    the round's steps over ``examples`` rows in batches of ``batch``."""

    model: nn.Module
    optimizer: LocalOptimizer
    examples: int
    batch: int
    steps: int

    @property
    def per_epoch(self) -> int:
        return -(-self.examples // self.batch)


def round_steps(work: Work, examples: int) -> int:
    """The optimiser steps of a round's local ``work`` over ``examples`` training rows:
    ``work.local_steps`` when set, else ``work.epochs`` passes in batches of
    ``min(work.batch_size, examples)`` (the last of a pass shorter); none without rows."""
    if work.local_steps is not None:
        return work.local_steps
    return work.epochs * -(-examples // min(work.batch_size, examples)) if examples else 0


def opening(job: ClientJob, hooks: Hooks) -> Opening | None:
    """The round's :class:`Opening` (:func:`round_steps` steps), or None for a client without
    training data."""
    model = job.model if hooks.model is None else hooks.model
    work = job.instruction.work
    n = job.x_train.shape[0]
    if n == 0:
        return None
    batch = min(work.batch_size, n)
    steps = round_steps(work, n)
    opt = hooks.optimizer if hooks.optimizer is not None else LocalOptimizer(model.parameters(), job.settings)
    return Opening(model, opt, n, batch, steps)


NOTHING = TrainResult(steps=0, num_examples=0, mean_loss=float("nan"))
"""The result of a round without training data."""


class SGDLoop:
    """The plain loop: mini-batches of ``work.batch_size`` shuffled with ``job.generator``, one
    optimiser step each."""

    def train(self, job: ClientJob, hooks: Hooks) -> TrainResult:
        start = opening(job, hooks)
        if start is None:
            return NOTHING
        model, opt, n, batch, per_epoch = start.model, start.optimizer, start.examples, start.batch, start.per_epoch
        loss, after_backward = hooks.loss, hooks.after_backward
        device = job.x_train.device
        model.train()
        loss_sum = 0.0  # float64, as a Python float: no tensor op per step
        seen = 0
        step = 0
        order = torch.empty(0, dtype=torch.long)
        while step < start.steps:
            position = step % per_epoch
            if position == 0:
                order = torch.randperm(n, generator=job.generator).to(device)
            idx = order[position * batch : (position + 1) * batch]
            x, y = rows(job.x_train, idx), rows(job.y_train, idx)
            opt.zero_grad()
            if loss is None:
                objective = reported = job.loss_fn(model(x), y)
            else:
                objective, reported = loss(model, x, y)
            objective.backward()
            if after_backward is not None:
                after_backward(model)
            opt.step()
            loss_sum += float(reported.detach()) * len(idx)
            seen += len(idx)
            step += 1
        return TrainResult(steps=start.steps, num_examples=n, mean_loss=loss_sum / seen)

    def report(self) -> dict[str, float]:
        """The plain loop spends nothing beyond the update."""
        return {}


SGD_LOOP: SGDLoop = SGDLoop()


def train_local(
    job: ClientJob,
    *,
    model: nn.Module | None = None,
    optimizer: LocalOptimizer | None = None,
    loss: LossHook | None = None,
    after_backward: AfterBackward | None = None,
) -> TrainResult:
    """Run the round's local work on ``job``'s training data, through the job's training (the
    plain loop, or the wrapper that took it over this round), changed by the :class:`Hooks` given."""
    return job.training.train(job, Hooks(model, optimizer, loss, after_backward))


def model_delta(model: nn.Module, start: Params) -> Params:
    """Trained parameters minus ``start``; integer buffers travel as their values."""
    out = {}
    for k, v in model.state_dict().items():
        v = v.detach()
        out[k] = v - start[k] if v.is_floating_point() else v.clone()
    return out


def delta_update(result: TrainResult, delta: Params, extras: Params | None = None) -> Update:
    """The update of a client half that trained with :func:`train_local` and sends its change of
    the model (``delta``, e.g. by :func:`model_delta`) and the extras of its algorithm."""
    return Update(
        kind=UpdateKind.DELTA,
        tensors=delta,
        num_examples=result.num_examples,
        metrics={"train_loss": result.mean_loss},
        extras=dict(extras or {}),
        local_steps=result.steps,
    )
