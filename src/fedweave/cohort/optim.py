"""The local optimisers on stacked parameters, one client per leading index, masked.

What :class:`~fedweave.training.LocalOptimizer` computes for one client (SGD with momentum and
weight decay, Adam), element by element with the same operations in the same order, on tensors
whose first dimension is the cohort's client; a client whose ``active`` entry is False at a step
keeps its parameters and optimiser state untouched, so it does exactly its own number of steps.
A cohort's clients all start together and stop at their own step, so every active client is at
the same step count: Adam's bias corrections are the sequential loop's Python floats.
"""

from __future__ import annotations

import torch

from fedweave.training import LocalSettings

Stacked = dict[str, torch.Tensor]


def _masked(active: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    return torch.where(active.view(-1, *([1] * (new.dim() - 1))), new, old)


class StackedOptimizer:
    """One optimiser state per client of a cohort, over the stacked trainable parameters."""

    def __init__(self, settings: LocalSettings):
        if settings.optimizer not in ("sgd", "adam"):
            raise ValueError(f"a cohort steps sgd or adam, not {settings.optimizer!r}")
        self.settings = settings
        self.state: dict[str, dict[str, torch.Tensor]] = {}

    @torch.no_grad()
    def step(self, t: int, params: Stacked, grads: Stacked, active: torch.Tensor, all_active: bool) -> Stacked:
        """The parameters after step ``t`` (0-based) of every client in ``active``."""
        s = self.settings
        out = {}
        for name, p in params.items():
            g = grads[name]
            if s.weight_decay:
                g = g.add(p, alpha=s.weight_decay)
            state = self.state.setdefault(name, {})
            if s.optimizer == "sgd":
                if s.momentum:
                    if t == 0:  # every client steps at t = 0: its buffer starts as its gradient
                        state["momentum"] = g
                    else:
                        buf = state["momentum"].mul(s.momentum).add(g)
                        state["momentum"] = buf if all_active else _masked(active, buf, state["momentum"])
                        g = buf
                new = p.add(g, alpha=-s.lr)
            else:
                beta1, beta2, eps = 0.9, 0.999, 1e-8
                if t == 0:
                    state["m"], state["v"] = torch.zeros_like(p), torch.zeros_like(p)
                m = state["m"].lerp(g, 1 - beta1)
                v = state["v"].mul(beta2).addcmul(g, g, value=1 - beta2)
                bias1 = 1 - beta1 ** (t + 1)
                bias2 = 1 - beta2 ** (t + 1)
                denom = (v.sqrt() / bias2**0.5).add_(eps)
                new = p.addcdiv(m, denom, value=-s.lr / bias1)
                state["m"] = m if all_active else _masked(active, m, state["m"])
                state["v"] = v if all_active else _masked(active, v, state["v"])
            out[name] = new if all_active else _masked(active, new, p)
        return out
