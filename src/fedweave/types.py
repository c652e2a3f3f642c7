"""Plain data that crosses module boundaries: parameters, instructions, updates, messages.

No behaviour lives here; these are the nouns of DESIGN.md's vocabulary.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, final

import torch

Params = dict[str, torch.Tensor]
"""Model parameters and buffers, named as in ``state_dict``."""


class UpdateKind(str, enum.Enum):
    """What the tensors of an update mean."""

    WEIGHTS = "weights"  # the client's new parameters
    DELTA = "delta"  # new parameters minus the global parameters the client received
    GRADIENT = "gradient"  # a gradient (data-parallel steps, FedSGD)


class TaskKind(str, enum.Enum):
    """What the server asks a client to do."""

    TRAIN = "train"
    EVALUATE = "evaluate"


@dataclass
class Work:
    """The local work the controller assigns one client for one round."""

    client_id: int
    batch_size: int
    epochs: int = 1
    local_steps: int | None = None  # when set, overrides epochs: exactly this many steps


ACCEPTED_ROUND = "accepted_round"
"""The key of ``Instruction.config`` by which the server tells a client the last round whose
update of that client it applied (0: none); the client then keeps or drops the state it
trained in that round (see :mod:`fedweave.federated.client`)."""


@final
@dataclass
class Instruction:
    """Server to client: what to do this round and with which parameters."""

    round: int
    task: TaskKind
    work: Work
    params: Params
    config: dict[str, Any] = field(default_factory=dict)  # scalar hyper-parameters (lr, mu, ...)
    extras: Params = field(default_factory=dict)  # algorithm tensors (e.g. a server control variate)
    applied: list[str] = field(default_factory=list)  # plugins applied on the wire, in order


@final
@dataclass
class Update:
    """Client to server: the result of local training."""

    kind: UpdateKind
    tensors: Params
    num_examples: int
    metrics: dict[str, float] = field(default_factory=dict)
    extras: Params = field(default_factory=dict)  # algorithm tensors (e.g. a control-variate delta)
    applied: list[str] = field(default_factory=list)
    client_id: int = -1
    local_steps: int = 0
    compute_time: float = 0.0  # seconds of local computation, measured by the client
    clients: int = 1  # client updates this one stands for (more when a site leader pre-aggregated)
    members: list[int] = field(default_factory=list)  # their client ids when pre-aggregated; empty: client_id

    @property
    def senders(self) -> list[int]:
        """The clients this update stands for: its ``members``, else its ``client_id``."""
        return self.members or [self.client_id]


@dataclass
class Evaluation:
    """Client to server: metrics of a model on the client's local test split."""

    num_examples: int
    metrics: dict[str, float]
    client_id: int = -1


@dataclass
class Control:
    """One step of a plugin's own protocol, server to client and back (secure aggregation's
    key set-up and unmasking). ``plugin`` names the plugin that answers it on the client,
    ``step`` the step; all its data (public keys, encrypted shares, client ids) travels as
    tensors, so the round's bytes count it."""

    plugin: str
    step: str
    tensors: Params = field(default_factory=dict)


@dataclass
class Message:
    """The one object that crosses a transport."""

    round: int
    client_id: int
    body: Body


@dataclass
class SiteJob:
    """Server to a site leader: one round's instructions (or control steps of a plugin's own
    protocol) for the site's members (client ids), and the seconds the server waits for the
    answer (None: no deadline)."""

    messages: list[Message]
    timeout: float | None = None


@dataclass
class SiteReply:
    """A site leader to the server: its members' replies (updates, evaluations, control answers;
    or one pre-aggregated update standing for ``clients`` of them, named in its ``members``) and
    each failed member's reason. ``broken``: why the site's own group is broken (it reaches none
    of its members until the site is restarted; then it answers for none), else None."""

    messages: list[Message]
    failures: dict[int, str] = field(default_factory=dict)
    broken: str | None = None


Body = Instruction | Update | Evaluation | Control | SiteJob | SiteReply
"""What a message carries: a client's body, or a site leader's batch of its members' (gRPC sites)."""


def params_nbytes(params: Params) -> int:
    """Bytes of raw tensor data in ``params`` (what a dense wire format carries)."""
    return sum(t.nbytes for t in params.values())


def body_nbytes(body: Body, nbytes: Callable[[Params], int] = params_nbytes) -> int:
    """Bytes of tensor data a message body carries (a site batch: its members' bodies'), each
    mapping of tensors measured by ``nbytes``."""
    if isinstance(body, (SiteJob, SiteReply)):
        return sum(body_nbytes(m.body, nbytes) for m in body.messages)
    if isinstance(body, Evaluation):
        return 0
    if isinstance(body, Control):
        return nbytes(body.tensors)
    tensors = body.params if isinstance(body, Instruction) else body.tensors
    return nbytes(tensors) + nbytes(body.extras)


def messages_nbytes(messages: Iterable[Message]) -> int:
    """``Σ body_nbytes`` of ``messages``, a mapping several of them hold (a round's broadcast: the
    same parameters in every instruction) measured once: ``messages`` keep it alive and unchanged
    while they are read, so its id names it."""
    known: dict[int, int] = {}

    def nbytes(tensors: Params) -> int:
        n = known.get(id(tensors))
        if n is None:
            n = known[id(tensors)] = params_nbytes(tensors)
        return n

    return sum(body_nbytes(m.body, nbytes) for m in messages)
