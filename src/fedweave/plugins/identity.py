"""The identity plugin: changes nothing. A template for new plugins and a test of the chain."""

from __future__ import annotations

from dataclasses import dataclass, replace

from fedweave.plugins.contracts import Payload, PluginContext
from fedweave.types import UpdateKind


@dataclass
class IdentityHParams:
    """No settings."""


class Identity:
    """Pass payloads through unchanged (as a copy, as every plugin must)."""

    name = "identity"
    HParams = IdentityHParams
    accepts = frozenset(UpdateKind)
    combines_encoded = False

    def __init__(self, hp: IdentityHParams):
        self.hp = hp

    def encode(self, payload: Payload, ctx: PluginContext) -> Payload:
        return replace(payload)

    def decode(self, payload: Payload, ctx: PluginContext) -> Payload:
        return replace(payload)
