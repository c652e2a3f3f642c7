"""SiteBatches: one job per top-level site, whose answer stands for its members (or fails them all)."""

from __future__ import annotations

import torch

from fedweave.topologies.deploy import SiteBatches
from fedweave.topologies.hierarchical import combine
from fedweave.transports.base import Exchange
from fedweave.transports.serialization import SiteJob, SiteReply
from fedweave.types import Instruction, Message, TaskKind, Update, UpdateKind, Work

PARAMS = {"w": torch.zeros(3)}


def leader(msg: Message) -> Message:
    """Site 0 pre-aggregates its members' updates (w + id, id + 1 examples); site 1 is down."""
    job = msg.body
    assert isinstance(job, SiteJob) and job.timeout == 9.0
    if msg.client_id == 1:
        raise ConnectionError("site 1 is down")
    updates = [Update(UpdateKind.WEIGHTS, {"w": m.body.params["w"] + m.client_id}, m.client_id + 1) for m in job.messages]
    first = job.messages[0].client_id
    return Message(msg.round, msg.client_id, SiteReply([Message(msg.round, first, combine(updates, first))], {}))


class Link:
    """Site leaders in this process: a leader that raises fails its site; counts one byte per job."""

    def __init__(self) -> None:
        self.jobs: list[Message] = []

    def exchange(self, messages: list[Message], timeout: float | None) -> Exchange:
        out = Exchange(bytes_sent=len(messages))
        for m in messages:
            self.jobs.append(m)
            try:
                out.replies.append(leader(m))
            except ConnectionError as exc:
                out.failures[m.client_id] = f"{type(exc).__name__}: {exc}"
        return out

    def close(self) -> None:
        """Nothing to release."""


def test_each_site_gets_one_job_and_its_answer_stands_for_its_members() -> None:
    link = Link()
    topology = SiteBatches([[0, [1, 2]], [3]], link)
    messages = [Message(4, c, Instruction(4, TaskKind.TRAIN, Work(c, 8), PARAMS)) for c in (3, 2, 0, 1, 9)]
    ex = topology.exchange(messages, 9.0)
    # one job per site, holding its members' messages (a nested site is part of its top-level site)
    assert [(j.client_id, [m.client_id for m in j.body.messages]) for j in link.jobs] == [(0, [2, 0, 1]), (1, [3])]
    (reply,) = ex.replies
    assert reply.client_id == 2 and reply.body.clients == 3 and reply.body.num_examples == 3 + 1 + 2
    assert torch.allclose(reply.body.tensors["w"], torch.full((3,), (3 * 2 + 1 * 0 + 2 * 1) / 6))
    assert ex.failures == {
        3: "site 1: ConnectionError: site 1 is down",
        9: "the client is in no site of topology.sites",
    }
    assert ex.bytes_sent == 2  # the link's traffic is the topology's
