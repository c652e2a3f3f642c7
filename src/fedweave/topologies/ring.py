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
        train = [
            m
            for m in messages
            if isinstance(m.body, Instruction) and m.body.task is TaskKind.TRAIN
        ]
        if not train:
            return self.transport.exchange(
                messages, timeout
            )  # evaluation of the observed consensus
        if self.models is None:
            start = train[0].body.params  # type: ignore[union-attr]
            self.models = [
                {k: v.clone() for k, v in start.items()} for _ in range(self.w.shape[0])
            ]
        own = [
            Message(
                m.round,
                m.client_id,
                dataclasses.replace(m.body, params=self.models[m.client_id]),
            )  # type: ignore[arg-type]
            for m in train
        ]
        result = self.transport.exchange(own, timeout)
        answered: dict[int, Update] = {}
        for reply in result.replies:
            update = reply.body
            if (
                not isinstance(update, Update)
                or update.applied
                or update.kind is UpdateKind.GRADIENT
            ):
                result.failures[reply.client_id] = (
                    "a gossip node must answer its new weights or delta in the clear"
                )
                continue
            own_model = self.models[reply.client_id]
            try:  # gossiped before the server sees it: checked here
                check_tensors(update.tensors, specs_of(own_model), "tensor")
            except Rejected as exc:
                result.failures[reply.client_id] = f"rejected: {exc}"
                continue
            trained = (
                update.tensors
                if update.kind is UpdateKind.WEIGHTS
                else apply_delta(own_model, update.tensors)
            )
            self.models[reply.client_id] = {
                k: v.detach().clone() for k, v in trained.items()
            }
            answered[reply.client_id] = update
        before = spread(self.models)
        for _ in range(self.gossip_steps):
            self.models = mix(self.models, self.w)
        after = spread(self.models)
        self.spread_history.append((before, after))
        log.info("round %d: gossip spread %.4g -> %.4g", train[0].round, before, after)
        result.replies = []
        for m in train:
            update = answered.get(m.client_id)
            if update is None:
                continue
            mixed = self.models[m.client_id]
            glob = m.body.params  # type: ignore[union-attr]
            tensors = (
                mixed
                if update.kind is UpdateKind.WEIGHTS
                else {
                    k: v - glob[k] if v.is_floating_point() else v
                    for k, v in mixed.items()
                }
            )
            result.replies.append(
                Message(
                    m.round, m.client_id, dataclasses.replace(update, tensors=tensors)
                )
            )
        return result

    def close(self) -> None:
        self.transport.close()
