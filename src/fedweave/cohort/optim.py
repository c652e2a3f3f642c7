"""The local optimisers on stacked parameters, one client per leading index.

What :class:`~fedweave.training.LocalOptimizer` computes for one client (SGD with momentum and
weight decay, Adam): the same in-place operations in the same order, on views of the first
``active`` clients of stacked tensors. A cohort's clients are ordered by their steps, the most
first, so at every step the clients not yet done are a prefix: a client past its own steps is
left out of the step, its parameters and optimiser state untouched, and does exactly its own
number of steps. All start together, so every client in a step is at the same step count: Adam's
bias corrections are the sequential loop's Python floats.
"""

from __future__ import annotations

import torch

from fedweave.training import LocalSettings

Stacked = dict[str, torch.Tensor]


class StackedOptimizer:
    """One optimiser state per client of a cohort, over the stacked trainable parameters."""

    def __init__(self, settings: LocalSettings):
        if settings.optimizer not in ("sgd", "adam"):
            raise ValueError(f"a cohort steps sgd or adam, not {settings.optimizer!r}")
        self.settings = settings
        self.state: dict[str, dict[str, torch.Tensor]] = {}

    @torch.no_grad()
    def step(self, t: int, params: Stacked, grads: Stacked, active: int) -> None:
        """Step ``t`` (0-based) of the first ``active`` clients of ``params``, in place; ``grads``
        holds their gradients (``active`` rows each)."""
        s = self.settings
        for name, stacked in params.items():
            p, g = stacked[:active], grads[name]
            if s.weight_decay:
                g = g.add(p, alpha=s.weight_decay)
            state = self.state.setdefault(name, {})
            if s.optimizer == "sgd":
                if s.momentum:
                    if t == 0:  # every client steps at t = 0: its buffer starts as its gradient
                        state["momentum"] = g.detach().clone()
                        g = state["momentum"]
                    else:
                        g = state["momentum"][:active].mul_(s.momentum).add_(g)
                p.add_(g, alpha=-s.lr)
            else:
                beta1, beta2, eps = 0.9, 0.999, 1e-8
                if t == 0:
                    state["m"], state["v"] = torch.zeros_like(stacked), torch.zeros_like(stacked)
                m, v = state["m"][:active], state["v"][:active]
                m.lerp_(g, 1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                bias1 = 1 - beta1 ** (t + 1)
                bias2 = 1 - beta2 ** (t + 1)
                denom = (v.sqrt() / bias2**0.5).add_(eps)
                p.addcdiv_(m, denom, value=-s.lr / bias1)
