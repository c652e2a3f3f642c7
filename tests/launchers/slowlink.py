"""A test plugin: a slow uplink. A client's update waits ``seconds`` before it leaves while
``hold_file`` exists, so rounds last long enough to kill a client mid-round, without burning CPU.

Named in a config as ``slowlink:SlowLink`` with this folder on ``PYTHONPATH``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace

from fedweave.plugins.contracts import Payload, PluginContext
from fedweave.schema import opt
from fedweave.types import UpdateKind


@dataclass
class SlowLinkHParams:
    seconds: float = opt(0.5, ge=0, help="delay of each update while hold_file exists")
    hold_file: str = opt("", help="the delay applies while this file exists (empty: always)")


class SlowLink:
    """Delay each update on the client; change nothing."""

    name = "slowlink"
    HParams = SlowLinkHParams
    accepts = frozenset(UpdateKind)
    combines_encoded = False

    def __init__(self, hp: SlowLinkHParams):
        self.hp = hp

    def encode(self, payload: Payload, ctx: PluginContext) -> Payload:
        if ctx.side == "client" and (not self.hp.hold_file or os.path.exists(self.hp.hold_file)):
            time.sleep(self.hp.seconds)
        return replace(payload)

    def decode(self, payload: Payload, ctx: PluginContext) -> Payload:
        return replace(payload)
