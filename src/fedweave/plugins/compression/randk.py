"""Random-k sparsification: send k entries of each tensor chosen at random.

Stich, Cordonnier & Jaggi, "Sparsified SGD with Memory", NeurIPS 2018
(https://arxiv.org/abs/1809.07599); Konečný et al., "Federated Learning: Strategies for
Improving Communication Efficiency", 2016 (https://arxiv.org/abs/1610.05492).

The positions are drawn from a seeded generator, so only its seed travels
(``name.__seed``, 8 bytes) with the values (``name.__values``). Without error feedback
the values are scaled by d/k, which makes the estimate unbiased: E[decode(encode(x))] = x.
Error feedback needs a contraction, so with it the values are sent unscaled
(Stich et al. 2018). With ``shared_indices`` every client of a round draws the same
positions, so encoded updates line up and can be summed while encoded (secure
aggregation; not HE, which adds each update into the encrypted model itself); otherwise each client draws its own (lower variance of the average).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from fedweave.plugins.compression.wire import Compressor, Site, require
from fedweave.schema import opt


@dataclass
class RandKParams:
    ratio: float = opt(0.1, gt=0, le=1, help="share of each tensor's entries sent (at least one)")
    error_feedback: bool = opt(False, help="keep what was not sent and add it next time (values then unscaled)")
    shared_indices: bool = opt(False, help="every client of a round sends the same positions (summable)")


HELD_POSITIONS = 1 << 22
"""At most this many drawn positions are kept for reuse (16 MB as int32)."""


class RandKCodec:
    def __init__(self, hp: RandKParams):
        self.hp = hp
        self.drawn: dict[tuple[int, int], torch.Tensor] = {}  # (seed, numel) -> positions
        self.held = 0  # positions in ``drawn``

    def compress(self, x: torch.Tensor, site: Site) -> dict[str, torch.Tensor]:
        flat = x.reshape(-1)
        keys = (site.name,) if self.hp.shared_indices else (site.client_id, site.name)
        seed = site.seed_for(*keys)
        indices = self._positions(seed, flat.numel())
        scale = 1.0 if self.hp.error_feedback else flat.numel() / indices.numel()
        values = flat.index_select(0, indices)
        return {"values": values if self.hp.error_feedback else values.mul_(scale), "seed": torch.tensor([seed], dtype=torch.int64)}

    def field_dtypes(self) -> dict[str, torch.dtype]:
        return {"values": torch.float32, "seed": torch.int64}

    def k(self, numel: int) -> int:
        """How many entries of a tensor of ``numel`` entries are sent."""
        return max(1, int(self.hp.ratio * numel))

    def check_fields(self, fields: dict[str, torch.Tensor], shape: tuple[int, ...]) -> None:
        require(fields, {"values": self.k(math.prod(shape)), "seed": 1})

    def decompress(self, fields: dict[str, torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        numel = math.prod(shape)
        out = torch.zeros(numel, dtype=torch.float32)
        out[self._positions(int(fields["seed"].item()), numel)] = fields["values"].to(torch.float32)
        return out.reshape(shape)

    def subtract_sent(self, x: torch.Tensor, fields: dict[str, torch.Tensor]) -> None:
        flat = x.view(-1)
        positions = self._positions(int(fields["seed"].item()), flat.numel())
        flat[positions] = flat.index_select(0, positions) - fields["values"].to(torch.float32)

    def _positions(self, seed: int, numel: int) -> torch.Tensor:
        """The first k of a seeded permutation. Drawing them is most of the codec's work, and
        in one process the same positions are needed again (the error feedback's residual,
        the server's decode in simulation): the latest draws are kept, oldest dropped first."""
        key = (seed, numel)
        if key in self.drawn:
            return self.drawn[key]
        k = self.k(numel)
        dtype = torch.int32 if numel <= torch.iinfo(torch.int32).max else torch.int64
        positions = torch.randperm(numel, generator=torch.Generator().manual_seed(seed), dtype=dtype)[:k].clone()
        while self.drawn and self.held + k > HELD_POSITIONS:
            self.held -= self.drawn.pop(next(iter(self.drawn))).numel()
        if k <= HELD_POSITIONS:
            self.drawn[key] = positions
            self.held += k
        return positions


def _summable(params: Any) -> bool:
    return bool(params.shared_indices)


class RandK(Compressor):
    """Random-k sparsification, unbiased (scaled by d/k) or with error feedback."""

    name = "randk"
    Params = RandKParams
    summable = staticmethod(_summable)

    def __init__(self, hp: RandKParams):
        super().__init__(RandKCodec(hp), hp.error_feedback)
        self.hp = hp
