"""Clipping of a whole update to an L2 norm: the sensitivity bound of differential privacy.

The norm is taken over all floating tensors of the update together, and the update is
scaled by min(1, C / ‖Δ‖). Usable alone (it also bounds what one client can move the
model) and inside the DP plugins, which clip before they add noise.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from fedweave.plugins.contracts import Declaration, PluginContext
from fedweave.schema import opt
from fedweave.types import Params, Update, UpdateKind


@dataclass
class ClipHParams:
    max_norm: float = opt(1.0, gt=0, help="L2 norm C that each update (all tensors together) is clipped to")


def l2_norm(tensors: Params) -> float:
    """The L2 norm of all floating tensors of ``tensors`` together."""
    squares = [t.detach().double().pow(2).sum() for t in tensors.values() if t.is_floating_point()]
    return float(torch.stack(squares).sum().sqrt()) if squares else 0.0


def clip_tensors(tensors: Params, max_norm: float) -> tuple[Params, float]:
    """``tensors`` scaled to L2 norm at most ``max_norm``, and their norm before clipping."""
    norm = l2_norm(tensors)
    scale = min(1.0, max_norm / norm) if norm > 0 else 1.0
    clipped = {k: v * scale if v.is_floating_point() else v for k, v in tensors.items()}
    return clipped, norm


class Clip:
    """Clip each update to an L2 norm (the whole update, all tensors together)."""

    name = "clip"
    HParams = ClipHParams
    accepts = frozenset({UpdateKind.DELTA, UpdateKind.GRADIENT})
    combines_encoded = False
    declares = Declaration(stage="clip", points=("client_send",), summable=True)

    def __init__(self, hp: ClipHParams):
        self.hp = hp

    def encode(self, payload: Update, ctx: PluginContext) -> Update:
        return replace(payload, tensors=clip_tensors(payload.tensors, self.hp.max_norm)[0])

    def decode(self, payload: Update, ctx: PluginContext) -> Update:
        return replace(payload)
