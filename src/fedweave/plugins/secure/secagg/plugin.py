"""The ``secagg`` plugin: its two halves (:mod:`.server`, :mod:`.client`) over one field, one
quantizer and the round's neighbourhoods."""

from __future__ import annotations

import math
from typing import Any

from fedweave.plugins.contracts import Declaration, FreshDraws
from fedweave.plugins.secure.secagg.client import SecAggClient
from fedweave.plugins.secure.secagg.masking import Field
from fedweave.plugins.secure.secagg.neighbours import ring
from fedweave.plugins.secure.secagg.params import SecAggHParams
from fedweave.plugins.secure.secagg.quantization import Quantizer
from fedweave.plugins.secure.secagg.server import SecAggServer, ServerRound
from fedweave.types import UpdateKind


class SecAgg(SecAggServer, SecAggClient):
    """Secure aggregation, SecAgg+ style: pairwise and self masks, Shamir recovery of drop-outs."""

    name = "secagg"
    HParams = SecAggHParams
    accepts = frozenset(UpdateKind)
    combines_encoded = True
    declares = Declaration(stage="secure", points=("client_send",))

    @staticmethod
    def fresh_draws(params: SecAggHParams) -> FreshDraws | None:
        """Stochastic rounding from the OS's secure source, unless seeded (the masks cancel in the sum)."""
        return None if params.seeded_noise else FreshDraws("stochastic rounding", releases=False)

    def __init__(self, hp: SecAggHParams):
        self.hp = hp
        self.field = Field(hp.bits)
        self.levels = (1 << (hp.bits - math.ceil(math.log2(hp.max_examples)))) - 1
        self.quantize = Quantizer.of(hp.clip_range, self.levels, self.field.width)
        self.seed = 0
        self.round: ServerRound | None = None
        self.excluded = 0  # clients the last round's checks of shares excluded

    def bind(self, config: Any) -> None:
        self.seed = config.seed

    def graph(self, rnd: int, cohort: list[int]) -> dict[int, tuple[int, ...]]:
        return ring(self.seed, rnd, tuple(sorted(cohort)), self.hp.neighbours)
