"""The server's jobs: one per message to a node, the shapes and kind its answer must have, and the
payload bytes it carries (what :class:`~fedweave.transports.grpc.server.GrpcServerTransport` posts,
hands out and checks)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedweave.errors import SerializationError
from fedweave.transports.serialization import SiteJob, SiteReply
from fedweave.types import Control, Evaluation, Instruction, Message, TaskKind, Update, body_nbytes


@dataclass
class Job:
    id: str
    client_id: int
    message: Message
    expected: dict[str, tuple[int, ...]] | None
    state: str = "pending"  # pending | sending | sent | done | failed
    reply: Message | None = None
    reason: str = ""
    bytes_sent: int = 0
    bytes_received: int = 0
    deadline: float | None = None  # monotonic seconds
    timeout: float | None = None
    posted: float = 0.0  # monotonic seconds
    answered: float | None = None

    @property
    def open(self) -> bool:
        return self.state in ("pending", "sending", "sent")


def expected_shapes(message: Message) -> dict[str, tuple[int, ...]] | None:
    """The shapes a plain update to this instruction (or to a site job's) must have (None when
    plugins encoded it)."""
    body = message.body
    bodies = [m.body for m in body.messages] if isinstance(body, SiteJob) else [body]
    shapes = {
        name: tuple(t.shape)
        for b in bodies
        if isinstance(b, Instruction) and b.task is TaskKind.TRAIN and not b.applied
        for name, t in b.params.items()
    }
    return shapes or None


def check_answer(sent: Message, body: object) -> None:
    """A client's answer must be an evaluation for an evaluation, a control step for a control step, else an update."""
    instruction = sent.body
    wanted: type[Evaluation | Update | Control]
    wanted = Evaluation if isinstance(instruction, Instruction) and instruction.task is TaskKind.EVALUATE else Update
    wanted = Control if isinstance(instruction, Control) else wanted
    if not isinstance(body, wanted):
        raise SerializationError(f"reply holds a {type(body).__name__}, expected a {wanted.__name__}")


def check_reply(job: Job, reply: Message) -> None:
    """A reply must answer its job: the node and round of its message and, for a site's job, an
    answer or a failure standing for each member once."""
    sent = job.message
    if reply.client_id != job.client_id or reply.round != sent.round:
        raise SerializationError(
            f"reply is for node {reply.client_id} round {reply.round}, expected node "
            f"{job.client_id} round {sent.round}"
        )
    if not isinstance(sent.body, SiteJob):
        check_answer(sent, reply.body)
        return
    if not isinstance(reply.body, SiteReply):
        raise SerializationError(f"reply holds a {type(reply.body).__name__}, expected a SiteReply")
    members = {m.client_id: m for m in sent.body.messages}
    counted = 0
    covered: set[int] = set(reply.body.failures)
    for item in reply.body.messages:
        if item.client_id not in members:
            raise SerializationError(f"the site answers for client {item.client_id}, which is not in its job")
        check_answer(members[item.client_id], item.body)
        counted += item.body.clients if isinstance(item.body, Update) else 1
        named = item.body.senders if isinstance(item.body, Update) else [item.client_id]
        ids = set(named)
        if item.client_id not in ids or len(ids) < len(named) or not ids <= set(members) or ids & covered:
            raise SerializationError(
                f"the site's answer for client {item.client_id} stands for clients {named}: not each of them "
                "once, including that client, from its job and not answered or failed already"
            )
        covered |= ids
    strangers = sorted(set(reply.body.failures) - set(members))
    if strangers:
        raise SerializationError(f"the site reports failures of clients {strangers}, which are not in its job")
    if counted + len(reply.body.failures) != len(members):
        raise SerializationError(
            f"the site's answers stand for {counted} clients and its failures for {len(reply.body.failures)}, "
            f"but its job had {len(members)}"
        )


def payload_nbytes(body: object) -> int:
    """The tensor data a body carries (:func:`~fedweave.types.body_nbytes`); a site's job or reply
    carries each tensor its members' messages share once, as its batch does on the wire."""
    if isinstance(body, (SiteJob, SiteReply)):
        distinct = {id(t): t for m in body.messages for t in _tensors(m.body)}
        return sum(t.numel() * t.element_size() for t in distinct.values())
    if isinstance(body, (Instruction, Update, Evaluation, Control)):
        return body_nbytes(body)
    return 0


def _tensors(body: object) -> list[Any]:
    if isinstance(body, Control):
        return list(body.tensors.values())
    if isinstance(body, Instruction):
        return [*body.params.values(), *body.extras.values()]
    if isinstance(body, Update):
        return [*body.tensors.values(), *body.extras.values()]
    return []
