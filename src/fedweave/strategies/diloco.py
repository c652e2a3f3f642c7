"""DiLoCo: inner AdamW steps on each client, outer Nesterov momentum on the averaged delta.

Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language
Models", 2023. https://arxiv.org/abs/2311.08105
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fedweave.schema import opt
from fedweave.strategies.aggregate import plain_average_option, step_floats
from fedweave.strategies.base import StrategyContext
from fedweave.strategies.fedavg import FedAvgBase, FedAvgClient
from fedweave.training import (
    ClientJob,
    LocalOptimizer,
    LocalSettings,
    delta_update,
    model_delta,
    train_local,
)
from fedweave.types import Params, Update


@dataclass
class DiLoCoHParams:
    outer_lr: float = opt(0.7, gt=0, help="outer (server) learning rate")
    outer_momentum: float = opt(0.9, ge=0, lt=1, help="outer momentum")
    nesterov: bool = opt(True, help="Nesterov outer momentum")
    inner_lr: float = opt(1e-3, gt=0, help="inner AdamW learning rate (local.lr does not apply)")
    inner_weight_decay: float = opt(0.01, ge=0, help="inner AdamW decoupled weight decay")
    beta1: float = opt(0.9, ge=0, lt=1, help="inner AdamW β1")
    beta2: float = opt(0.999, ge=0, lt=1, help="inner AdamW β2")
    eps: float = opt(1e-8, gt=0, help="inner AdamW ε")
    keep_inner_state: bool = opt(
        True, help="clients keep their AdamW moments across rounds, as DiLoCo's workers do (false: fresh each round)"
    )
    plain_average: list[str] = plain_average_option("outer step")


class InnerAdamW(LocalOptimizer):
    """What ``torch.optim.AdamW`` computes with its default flags (single-tensor path, a step count per parameter).

    Its state is named by parameter, so a client can keep it in ``job.state``.
    """

    def __init__(self, model: nn.Module, hp: DiLoCoHParams, saved: dict[str, dict[str, torch.Tensor]]):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        settings = LocalSettings(optimizer="adamw", lr=hp.inner_lr, momentum=0.0, weight_decay=hp.inner_weight_decay)
        super().__init__([p for _, p in named], settings)
        self.betas = (hp.beta1, hp.beta2)
        self.eps = hp.eps
        self.names = [n for n, _ in named]
        self.state = [dict(saved.get(n, {})) for n in self.names]

    @torch.no_grad()
    def step(self) -> None:
        lr, weight_decay = self.settings.lr, self.settings.weight_decay
        beta1, beta2 = self.betas
        for p, state in zip(self.params, self.state):
            if p.grad is None:
                continue
            if not state:
                state.update(
                    step=torch.zeros((), dtype=torch.int64), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p)
                )
            state["step"] += 1
            step = int(state["step"])
            g = p.grad
            if weight_decay:
                p.mul_(1 - lr * weight_decay)
            state["exp_avg"].lerp_(g, 1 - beta1)
            state["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
            bias1 = 1 - beta1**step
            bias2 = 1 - beta2**step
            denom = (state["exp_avg_sq"].sqrt() / bias2**0.5).add_(self.eps)
            p.addcdiv_(state["exp_avg"], denom, value=-(lr / bias1))

    def saved(self) -> dict[str, dict[str, torch.Tensor]]:
        """The moments and step counts, by parameter name."""
        return {n: state for n, state in zip(self.names, self.state) if state}


class DiLoCoClient(FedAvgClient[DiLoCoHParams]):
    """H inner AdamW steps (the round's local work: ``local.steps``, else ``local.epochs``); sends the delta.

    The inner optimiser is always AdamW with this strategy's settings (defaults: torch's);
    ``local.optimizer``, ``local.lr``, ``local.momentum`` and ``local.weight_decay`` do not apply.
    """

    def train(self, job: ClientJob) -> Update:
        saved = job.state.get("inner", {}) if self.hp.keep_inner_state else {}
        optimizer = InnerAdamW(job.model, self.hp, saved)
        result = train_local(job, optimizer=optimizer)
        if self.hp.keep_inner_state:
            job.state["inner"] = optimizer.saved()
        return delta_update(result, model_delta(job.model, job.instruction.params))


class DiLoCo(FedAvgBase[DiLoCoHParams]):
    """DiLoCo (Douillard et al., 2023): an outer SGD step with Nesterov momentum on the pseudo-gradient.

    The pseudo-gradient is g = −Δ̄, Δ̄ the clients' deltas combined by ``ctx.average``
    (example-weighted, where the paper's workers hold equal shares); then, as
    ``torch.optim.SGD(lr, momentum, nesterov)``: b ← μ·b + g (b = g at first),
    θ ← θ − lr·(g + μ·b) with Nesterov, θ − lr·b without. Tensors matching
    ``plain_average`` (BatchNorm running statistics) take θ + Δ̄, with no momentum:
    an outer step could overshoot a variance below zero. Integer buffers take the
    combined value. With outer_lr 1 and momentum 0 the server step is FedAvg's.
    """

    HParams = DiLoCoHParams
    Client = DiLoCoClient

    def __init__(self, hp: DiLoCoHParams, ctx: StrategyContext):
        super().__init__(hp, ctx)
        self.momentum: Params = {}

    def aggregate(self, rnd: int, params: Params, updates: list[Update]) -> Params:
        hp = self.hp
        delta = self.ctx.average([u.tensors for u in updates], [u.num_examples for u in updates])
        stepped = step_floats(
            params, delta, hp.plain_average, lambda name, p, d: p - hp.outer_lr * self._direction(name, -d)
        )
        return stepped

    def _direction(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        m = self.hp.outer_momentum
        if not m:
            return grad
        buf = self.momentum.get(name)
        buf = grad.clone() if buf is None else buf.mul_(m).add_(grad)
        self.momentum[name] = buf
        return grad.add(buf, alpha=m) if self.hp.nesterov else buf

    def state_dict(self) -> dict[str, Any]:
        return {"momentum": self.momentum}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.momentum = {k: v.clone() for k, v in state["momentum"].items()}
