"""The local optimisers on stacked parameters, one client per leading index.

What :class:`~fedweave.training.LocalOptimizer` computes for one client (SGD with momentum and
weight decay, Adam): the same in-place operations in the same order, on views of the first
``active`` clients of stacked tensors. A cohort's clients are ordered by their steps, the most
first, so at every step the clients not yet done are a prefix: a client past its own steps is
left out of the step, its parameters and optimiser state untouched, and does exactly its own
number of steps. All start together, so every client in a step is at the same step count: Adam's
bias corrections are the sequential loop's Python floats.

A cohort's largest tensors (the stacked parameters, their gradients and optimiser state, the
gathered batches) are taken from a :class:`Workspace` kept with the model from one group and
round to the next, not allocated anew: freed between rounds, memory of that size goes back to the
operating system, and the next round's first touch of it page-faults (~6,000 faults a round for
100 digits MLP clients, several milliseconds).
"""

from __future__ import annotations

import torch

from fedweave.training import LocalSettings

Stacked = dict[str, torch.Tensor]


class Workspace:
    """Tensors reused by a model's cohorts: :meth:`take` gives the first rows of a kept tensor of
    the same trailing shape, dtype and device (contiguous, its values whatever they were), or a
    new one (kept instead) where none holds as many rows."""

    def __init__(self) -> None:
        self._kept: dict[object, torch.Tensor] = {}

    def take(self, key: object, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        kept = self._kept.get(key)
        if kept is None or kept.shape[1:] != shape[1:] or kept.shape[0] < shape[0] or kept.dtype != dtype or kept.device != device:
            kept = self._kept[key] = torch.empty(shape, dtype=dtype, device=device)
        return kept[: shape[0]]

    def like(self, key: object, tensor: torch.Tensor) -> torch.Tensor:
        """:meth:`take` of ``tensor``'s shape, dtype and device."""
        return self.take(key, tuple(tensor.shape), tensor.dtype, tensor.device)


class StackedOptimizer:
    """One optimiser state per client of a cohort, over the stacked trainable parameters."""

    def __init__(self, settings: LocalSettings, workspace: Workspace | None = None):
        if settings.optimizer not in ("sgd", "adam"):
            raise ValueError(f"a cohort steps sgd or adam, not {settings.optimizer!r}")
        self.settings = settings
        self.workspace = Workspace() if workspace is None else workspace
        self.state: dict[str, list[torch.Tensor]] = {}  # "params" and each kind of state, one tensor per parameter
        self._views: dict[int, dict[str, list[torch.Tensor]]] = {}  # per active count: the first clients' views
        self._named: dict[int, Stacked] = {}  # per active count: their momentum buffers by name

    def _prefix(self, params: Stacked, active: int) -> dict[str, list[torch.Tensor]]:
        if not self.state:  # the state of every client, made at the first step (which every client takes)
            self.state["params"] = list(params.values())
            s = self.settings
            if s.optimizer == "adam":
                self.state["m"] = [self.workspace.like(("m", name), p).zero_() for name, p in params.items()]
                self.state["v"] = [self.workspace.like(("v", name), p).zero_() for name, p in params.items()]
        views = self._views.get(active)
        if views is None:
            views = self._views[active] = {kind: [t[:active] for t in ts] for kind, ts in self.state.items()}
        return views

    def momentum_buffers(self, t: int, params: Stacked, active: int) -> tuple[Stacked, float | None] | None:
        """Where step ``t``'s caller may add the gradients into the momentum buffers itself (SGD with
        momentum, no weight decay): the buffers of the first ``active`` clients by name, and the
        factor of their old values (None at t = 0: the buffers start as the gradients), to be made
        ``buffer = momentum * buffer + gradient`` and passed to :meth:`step` with ``accumulated``;
        None where the optimiser must see the gradients alone. (A weight's gradient is a batched
        product: added into its buffer as one ``baddbmm_``, it is never written out alone.)"""
        s = self.settings
        if s.optimizer != "sgd" or not s.momentum or s.weight_decay:
            return None
        if t == 0:
            self._prefix(params, active)
            self.state["momentum"] = [self.workspace.like(("momentum", name), p) for name, p in params.items()]
            self._views.clear()
            self._named.clear()
        named = self._named.get(active)
        if named is None:
            named = self._named[active] = dict(zip(params, self._prefix(params, active)["momentum"]))
        return named, None if t == 0 else s.momentum

    @torch.no_grad()
    def step(self, t: int, params: Stacked, grads: Stacked, active: int, accumulated: bool = False) -> None:
        """Step ``t`` (0-based) of the first ``active`` clients of ``params`` (the same tensors at
        every step), in place; ``grads`` holds their gradients (``active`` rows each, in the order of
        ``params``), or with ``accumulated`` the momentum buffers the caller has updated with them
        (:meth:`momentum_buffers`). One ``torch._foreach_*`` call per operation over all the
        parameters (on a CPU the per-tensor operations, in the same order)."""
        s = self.settings
        views = self._prefix(params, active)
        p = views["params"]
        g = list(grads.values())
        if accumulated:
            torch._foreach_add_(p, g, alpha=-s.lr)
            return
        if s.weight_decay:
            g = list(torch._foreach_add(g, p, alpha=s.weight_decay))
        if s.optimizer == "sgd":
            if s.momentum:
                if t == 0:  # every client steps at t = 0: its buffer starts as its gradient
                    self.state["momentum"] = g = [
                        self.workspace.like(("momentum", name), gi).copy_(gi) for name, gi in zip(params, g)
                    ]
                    self._views.clear()
                    self._named.clear()
                else:
                    bufs = views["momentum"]
                    torch._foreach_mul_(bufs, s.momentum)
                    torch._foreach_add_(bufs, g)
                    g = bufs
            torch._foreach_add_(p, g, alpha=-s.lr)
        else:
            beta1, beta2, eps = 0.9, 0.999, 1e-8
            m, v = views["m"], views["v"]
            torch._foreach_lerp_(m, g, 1 - beta1)
            torch._foreach_mul_(v, beta2)
            torch._foreach_addcmul_(v, g, g, value=1 - beta2)
            bias1 = 1 - beta1 ** (t + 1)
            bias2 = 1 - beta2 ** (t + 1)
            denom = torch._foreach_sqrt(v)
            torch._foreach_div_(denom, bias2**0.5)
            torch._foreach_add_(denom, eps)
            torch._foreach_addcdiv_(p, m, denom, value=-s.lr / bias1)
