"""SecAgg's options (``plugins.client_send[i]`` of ``name: secagg``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from fedweave.errors import ConfigError
from fedweave.schema import opt


@dataclass
class SecAggHParams:
    neighbours: int | None = opt(
        None, ge=2, help="SecAgg+: each client masks with this many others (none: all others, as in SecAgg)"
    )
    threshold: float = opt(
        0.6, gt=0.5, le=1, help="share t of a neighbourhood (the client included) that must survive to unmask it"
    )
    bits: int = opt(32, ge=16, le=64, help="updates are summed in the integers mod 2^bits (wire: 4 bytes up to 32)")
    clip_range: float = opt(4.0, gt=0, help="R: entries are clipped to [-R, R] before quantization")
    max_examples: int = opt(65536, ge=1, help="most training examples a round's updates hold together")
    seeded_noise: bool = opt(
        False,
        help="draw the stochastic rounding from the run seed (reproducible; simulation only: anyone with the "
        "config can redraw it)",
    )

    def validate(self, prefix: str) -> None:
        if self.bits - math.ceil(math.log2(self.max_examples)) < 8:
            raise ConfigError(
                f"config key '{prefix}.max_examples': {self.max_examples} leaves fewer than 8 bits of precision "
                f"in a field of {self.bits} bits; raise bits or lower max_examples"
            )
