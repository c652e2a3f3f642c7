"""A site member's side: its serve loop, running the jobs of the clients it serves in a thread of
their own, each bounded by the round's timeout, and answering the leader."""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

from fedweave.transports import serialization
from fedweave.transports.torchdist.group import SiteGroup
from fedweave.transports.torchdist.reduce import reduce_update, update_layout
from fedweave.transports.torchdist.world import World
from fedweave.types import Control, Instruction, Message, Update, Work

log = logging.getLogger(__name__)

Handler = Callable[[Message], Message]


class TorchDistMember(SiteGroup):
    """A member of a site: serves the clients the leader assigns it with ``handler`` until told to stop."""

    def __init__(
        self,
        world: World,
        group: tuple[Any, Any],
        ranks: Sequence[int],
        handler: Handler,
    ):
        super().__init__(world, group, ranks)
        self.handler = handler
        self._late: threading.Thread | None = None  # jobs of an earlier round still running

    def serve(self) -> int:
        """Answer rounds until the leader stops the site; return the jobs answered."""
        done = 0
        while True:
            header = json.loads(self.broadcast_bytes(None, idle=True))
            if header["op"] == "stop":
                return done
            timeout = header.get("timeout")
            deadline = None if timeout is None else time.monotonic() + timeout
            blob = self.broadcast_bytes(None)
            own = self.scatter_bytes(None) if header["controls"] else bytearray()
            offsets = [0]
            for size in header["sizes"]:
                offsets.append(offsets[-1] + size)
            mine: list[tuple[int, Message]] = []
            failures: dict[int, str] = {}
            for rank, index, cid, work in header["jobs"]:
                if rank != self.world.rdv.rank:
                    continue
                try:
                    template = serialization.decode(
                        blob[offsets[index] : offsets[index + 1]], copy=True
                    )
                    if not isinstance(template.body, Instruction):
                        raise serialization.SerializationError(
                            f"a shared template holds a {type(template.body).__name__}, not an instruction"
                        )
                    body = dataclasses.replace(template.body, work=Work(**work))
                    mine.append((cid, Message(template.round, cid, body)))
                except Exception as exc:  # one client's failure must not stop the site
                    log.warning("client %d: instruction refused: %s", cid, exc)
                    failures[cid] = f"{type(exc).__name__}: {exc}"
            offset = 0
            for rank, cid, size in header["controls"]:
                if rank != self.world.rdv.rank:
                    continue
                data, offset = own[offset : offset + size], offset + size
                try:
                    msg = serialization.decode(data)
                    if not isinstance(msg.body, Control) or msg.client_id != cid:
                        raise serialization.SerializationError(
                            f"a control step for client {cid} holds a {type(msg.body).__name__} for client {msg.client_id}"
                        )
                    mine.append((cid, msg))
                except Exception as exc:  # one client's failure must not stop the site
                    log.warning("client %d: control step refused: %s", cid, exc)
                    failures[cid] = f"{type(exc).__name__}: {exc}"
            answers = self._run(mine, deadline, timeout)
            replies: list[tuple[dict[str, Any], bytes, Message]] = []
            for cid, _ in mine:
                reply = answers[cid]
                if isinstance(reply, str):
                    failures[cid] = reply
                    continue
                encoded = bytes(serialization.encode(reply))
                replies.append((self._describe(reply, len(encoded)), encoded, reply))
                done += 1
            self.gather_bytes(
                json.dumps(
                    {"replies": [r[0] for r in replies], "failures": failures}
                ).encode()
            )
            mode = json.loads(self.broadcast_bytes(None))
            if (
                mode["mode"] == "reduce"
            ):  # this member's updates form one contribution to the sum
                # the leader reduces only when every reply is a combinable Update (see _describe)
                reduce_update(
                    self, mode["layout"], [cast(Update, r[2].body) for r in replies], mode["bucket"]
                )
            else:
                self.gather_bytes(b"".join(r[1] for r in replies))

    def _run(
        self, jobs: list[tuple[int, Message]], deadline: float | None, timeout: float | None
    ) -> dict[int, Message | str]:
        """Each job's reply, or why it failed: the jobs run in order in a thread of their own, and
        those not done by ``deadline`` fail (the thread finishes its current job, then stops)."""
        answers: dict[int, Message | str] = {}
        stop = threading.Event()

        def work() -> None:
            for cid, msg in jobs:
                if stop.is_set():
                    return
                try:
                    answers[cid] = self.handler(msg)
                except Exception as exc:  # one client's failure must not stop the site
                    log.warning("client %d failed: %s", cid, exc, exc_info=True)
                    answers[cid] = f"{type(exc).__name__}: {exc}"

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        if self._late is not None:
            self._late.join(left())
            if self._late.is_alive():
                why = "still training a job of an earlier round that missed its deadline"
                return {cid: why for cid, _ in jobs}
            self._late = None
        thread = threading.Thread(target=work, name="fedweave-member-jobs", daemon=True)
        thread.start()
        thread.join(left())
        if thread.is_alive():
            stop.set()
            self._late = thread
        done = dict(answers)  # a job that ends from now on is late: dropped
        missed = f"missed the round deadline ({timeout:.3g} s)" if timeout is not None else "no answer"
        for cid, _ in jobs:
            if cid not in done:
                log.warning("client %d: %s", cid, missed)
        return {cid: done.get(cid, missed) for cid, _ in jobs}

    @staticmethod
    def _describe(reply: Message, size: int) -> dict[str, Any]:
        body = reply.body
        desc: dict[str, Any] = {
            "client_id": reply.client_id,
            "size": size,
            "combinable": False,
        }
        if isinstance(body, Update):
            desc.update(
                combinable=not body.applied and not body.extras,
                kind=body.kind.value,
                layout=update_layout(body),
                num_examples=body.num_examples,
                metrics=body.metrics,
                local_steps=body.local_steps,
                compute_time=body.compute_time,
            )
        return desc
