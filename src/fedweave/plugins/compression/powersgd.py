"""PowerSGD: low-rank compression by one step of power iteration, warm-started.

Vogels, Karimireddy & Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization", NeurIPS 2019 (https://arxiv.org/abs/1905.13727).

A tensor with two or more dimensions is viewed as a matrix M (n × m, the first
dimension against the rest). With Q (m × r) from the previous round of the same client
and tensor (the warm start; random normal the first time): P = orthonormalize(M Q),
Q = Mᵀ P, and M ≈ P Qᵀ. P and Q travel as float32 (``name.__p``, ``name.__q``): r(n + m)
numbers instead of nm. A matrix of rank ≤ r comes back exactly; for any other the
error shrinks towards the best rank-r approximation as the warm start repeats.
Vectors (biases) and matrices too small to gain travel dense.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from fedweave.plugins.compression.wire import Compressor, Site, require
from fedweave.schema import opt


@dataclass
class PowerSGDHParams:
    rank: int = opt(4, ge=1, help="rank r of the approximation")
    error_feedback: bool = opt(True, help="keep what the approximation missed and add it next time")


class PowerSGDCodec:
    def __init__(self, hp: PowerSGDHParams):
        self.hp = hp
        self.warm: dict[tuple[str, int, str], torch.Tensor] = {}  # (direction, client, tensor) -> Q

    def compress(self, x: torch.Tensor, site: Site) -> dict[str, torch.Tensor] | None:
        if x.dim() < 2:
            return None
        matrix = x.reshape(x.shape[0], -1)
        n, m = matrix.shape
        rank = min(self.hp.rank, n, m)
        if rank * (n + m) >= n * m:
            return None
        key = (site.direction, site.client_id, site.name)
        q = self.warm.get(key)
        if q is None or q.shape != (m, rank):
            q = torch.randn(m, rank, generator=site.generator(site.client_id, site.name))
        p = torch.linalg.qr(matrix @ q).Q.contiguous()  # laid out as the receiver gets it: both decode alike
        q = matrix.T @ p
        self.warm[key] = q
        return {"p": p, "q": q}

    def field_dtypes(self) -> dict[str, torch.dtype]:
        return {"p": torch.float32, "q": torch.float32}

    def check_fields(self, fields: dict[str, torch.Tensor], shape: tuple[int, ...]) -> None:
        if len(shape) < 2:
            raise ValueError("a tensor of fewer than two dimensions travels dense")
        n, m = shape[0], math.prod(shape[1:])
        rank = min(self.hp.rank, n, m)
        require(fields, {"p": n * rank, "q": m * rank})
        if fields["p"].shape != (n, rank) or fields["q"].shape != (m, rank):
            raise ValueError(f"'p' is {tuple(fields['p'].shape)} and 'q' {tuple(fields['q'].shape)}, "
                             f"the layout's tensor sends {(n, rank)} and {(m, rank)}")

    def decompress(self, fields: dict[str, torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        return (fields["p"] @ fields["q"].T).reshape(shape)

    def state_dict(self) -> dict[str, Any]:
        return {"warm": self.warm}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.warm = state["warm"]


class PowerSGD(Compressor):
    """PowerSGD (Vogels et al. 2019): rank-r power-iteration compression, warm-started."""

    name = "powersgd"
    HParams = PowerSGDHParams

    def __init__(self, hp: PowerSGDHParams):
        super().__init__(PowerSGDCodec(hp), hp.error_feedback)
        self.hp = hp
