"""A test plugin: a client process that dies right after its masked update left, before
secure aggregation's unmasking step. The other clients hold their updates a little, so the
server asks for shares only once the process is dead.

Named in a config as ``secagg_crash:CrashAfterMasking`` (before ``secagg``) with this folder
on ``PYTHONPATH``. It never changes a payload.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, replace

from fedweave.plugins.contracts import Declaration, Payload, PluginContext
from fedweave.schema import opt
from fedweave.types import UpdateKind


@dataclass
class CrashHParams:
    client: int = opt(0, ge=0, help="the client whose process dies")
    round: int = opt(1, ge=1, help="the round it dies in")
    after: float = opt(1.5, ge=0, help="seconds after its update is encoded")
    others_wait: float = opt(3.0, ge=0, help="seconds the other clients hold their updates in that round")


class CrashAfterMasking:
    name = "crash_after_masking"
    HParams = CrashHParams
    accepts = frozenset(UpdateKind)
    combines_encoded = False
    declares = Declaration(summable=True)  # it changes nothing, so secagg may follow it

    def __init__(self, hp: CrashHParams):
        self.hp = hp

    def encode(self, payload: Payload, ctx: PluginContext) -> Payload:
        if ctx.side == "client" and ctx.round == self.hp.round:
            if ctx.client_id == self.hp.client:
                threading.Timer(self.hp.after, os.kill, (os.getpid(), signal.SIGKILL)).start()
            else:
                time.sleep(self.hp.others_wait)
        return replace(payload)

    def decode(self, payload: Payload, ctx: PluginContext) -> Payload:
        return replace(payload)
