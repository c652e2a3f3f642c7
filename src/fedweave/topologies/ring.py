"""The ring topology: decentralized gossip, neighbour averaging with a mixing matrix.

Every node keeps its own model. Each round a sampled node trains locally from *its own*
model (the server's parameters in the instruction are replaced), then every node mixes
with its neighbours, ``x_i ← Σ_j W_ij x_j``, ``gossip_steps`` times. ``W`` holds the
Metropolis-Hastings weights of the ring, ``W_ij = 1 / (1 + max(deg_i, deg_j))`` for
neighbours and the rest on the diagonal: symmetric and doubly stochastic, so mixing keeps
the nodes' mean and shrinks their spread by the second-largest eigenvalue's modulus.

No server step shapes training: the loop's server only *observes*. Each node answers
with its mixed model (as the kind of update its algorithm sends), so a weighted-mean
strategy (FedAvg) computes the example-weighted mean of the node models, the consensus
that the loop evaluates and checkpoints.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from fedweave.strategies.aggregate import apply_delta
from fedweave.transports.base import Exchange, Transport
from fedweave.types import Instruction, Message, Params, TaskKind, Update, UpdateKind
from fedweave.federated.checks import Rejected, check_tensors, specs_of

log = logging.getLogger(__name__)


def ring_neighbours(n: int) -> list[list[int]]:
    """Each node's neighbours on a ring of ``n`` nodes."""
    if n == 1:
        return [[]]
    return [sorted({(i - 1) % n, (i + 1) % n}) for i in range(n)]


def metropolis(neighbours: list[list[int]]) -> torch.Tensor:
    """The Metropolis-Hastings mixing matrix of an undirected graph (doubly stochastic)."""
    n = len(neighbours)
    w = torch.zeros(n, n, dtype=torch.float64)
    for i, nbrs in enumerate(neighbours):
        for j in nbrs:
            w[i, j] = 1.0 / (1 + max(len(neighbours[i]), len(neighbours[j])))
        w[i, i] = 1.0 - float(w[i].sum())
    return w


def mix(models: list[Params], w: torch.Tensor) -> list[Params]:
    """``x_i ← Σ_j W_ij x_j`` for floating tensors; integer tensors (counters) take the maximum."""
    out: list[Params] = []
    for i in range(len(models)):
        mixed: Params = {}
        for name, first in models[0].items():
            if first.is_floating_point():
                acc = torch.zeros_like(first, dtype=torch.float64)
                for j, m in enumerate(models):
                    if w[i, j] != 0:
                        acc.add_(m[name].to(torch.float64), alpha=float(w[i, j]))
                mixed[name] = acc.to(first.dtype)
            else:
                mixed[name] = torch.stack([m[name] for m in models]).amax(0)
        out.append(mixed)
    return out


def spread(models: list[Params]) -> float:
    """The largest distance of a node's model from the nodes' mean (floating tensors)."""
    names = [k for k, v in models[0].items() if v.is_floating_point()]
    flat = torch.stack(
        [torch.cat([m[k].double().flatten() for k in names]) for m in models]
    )
    return float((flat - flat.mean(0)).norm(dim=1).max())


def training(messages: list[Message]) -> list[tuple[Message, Instruction]]:
    """The messages that ask a node to train, each with its instruction."""
    return [(m, m.body) for m in messages if isinstance(m.body, Instruction) and m.body.task is TaskKind.TRAIN]


def own_models(train: list[tuple[Message, Instruction]], models: list[Params]) -> list[Message]:
    """Each training message with its node's own model in place of the global one."""
    return [
        Message(m.round, m.client_id, dataclasses.replace(instruction, params=models[m.client_id]))
        for m, instruction in train
    ]


class Ring:
    """Gossip over a ring of ``num_nodes`` nodes whose local training runs over ``transport``."""

    def __init__(self, transport: Transport, num_nodes: int, gossip_steps: int = 1):
        self.transport = transport
        self.w = metropolis(ring_neighbours(num_nodes))
        self.gossip_steps = gossip_steps
        self.models: list[Params] | None = None
        self.spread_history: list[
            tuple[float, float]
        ] = []  # per round: before mixing, after mixing

    def exchange(self, messages: list[Message], timeout: float | None) -> Exchange:
        """Train each node from its own model, check and keep what it trained, gossip, answer the mixed models."""
        train = training(messages)
        if not train:
            return self.transport.exchange(messages, timeout)  # evaluation of the observed consensus
        models = self._models_from(train[0][1].params)
        result = self.transport.exchange(own_models(train, models), timeout)
        answered = self._keep_trained(result, models)
        self._gossip(train[0][0].round)
        result.replies = self._mixed_replies(train, answered)
        return result

    def _models_from(self, start: Params) -> list[Params]:
        """The nodes' models, each a copy of ``start`` in the first round."""
        if self.models is None:
            self.models = [{k: v.clone() for k, v in start.items()} for _ in range(self.w.shape[0])]
        return self.models

    def _keep_trained(self, result: Exchange, models: list[Params]) -> dict[int, Update]:
        """Each node's trained model replaces its own; a reply that is not new weights or a delta in
        the clear, or whose tensors do not fit the model, fails (gossiped before the server sees it)."""
        answered: dict[int, Update] = {}
        for reply in result.replies:
            update = reply.body
            if not isinstance(update, Update) or update.applied or update.kind is UpdateKind.GRADIENT:
                result.failures[reply.client_id] = "a gossip node must answer its new weights or delta in the clear"
                continue
            own_model = models[reply.client_id]
            try:
                check_tensors(update.tensors, specs_of(own_model), "tensor")
            except Rejected as exc:
                result.failures[reply.client_id] = f"rejected: {exc}"
                continue
            trained = update.tensors if update.kind is UpdateKind.WEIGHTS else apply_delta(own_model, update.tensors)
            models[reply.client_id] = {k: v.detach().clone() for k, v in trained.items()}
            answered[reply.client_id] = update
        return answered

    def _gossip(self, rnd: int) -> None:
        """``gossip_steps`` mixing steps over the ring; the spread before and after is recorded."""
        assert self.models is not None
        before = spread(self.models)
        for _ in range(self.gossip_steps):
            self.models = mix(self.models, self.w)
        after = spread(self.models)
        self.spread_history.append((before, after))
        log.info("round %d: gossip spread %.4g -> %.4g", rnd, before, after)

    def _mixed_replies(self, train: list[tuple[Message, Instruction]], answered: dict[int, Update]) -> list[Message]:
        """Each answering node's mixed model, as the kind of update it sent (weights, or a delta
        from the global model it was sent)."""
        assert self.models is not None
        replies = []
        for m, instruction in train:
            update = answered.get(m.client_id)
            if update is None:
                continue
            mixed = self.models[m.client_id]
            glob = instruction.params
            tensors = (
                mixed
                if update.kind is UpdateKind.WEIGHTS
                else {k: v - glob[k] if v.is_floating_point() else v for k, v in mixed.items()}
            )
            replies.append(Message(m.round, m.client_id, dataclasses.replace(update, tensors=tensors)))
        return replies

    def close(self) -> None:
        self.transport.close()
