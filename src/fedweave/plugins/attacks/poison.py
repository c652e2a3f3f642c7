"""Poisoning attacks of a chosen set of clients, for experiments (config ``attacks``).

A client named in ``attacks.clients`` trains as usual, then does each of ``attacks.kind``
(one attack or a list, applied in its order):

- ``sign_flip``: sends its update's opposite, scaled: Δ ← −scale · Δ (with ``scale`` 10,
  the sign-flip-and-scale attack of the robust-aggregation literature);
- ``scaling``: sends Δ ← scale · Δ (model replacement, Bagdasaryan et al. 2020);
- ``noise``: sends Δ + N(0, std²) per entry, drawn from a generator seeded by the run
  seed, round and client (an experiment is reproducible);
- ``label_flip``: trains on flipped labels, y ← C − 1 − y for C classes (the update is
  honest training on poisoned data);
- ``inflate_examples``: claims ``examples`` examples, so that a mean weighted by examples
  follows it (the server's :class:`~fedweave.federated.checks.ExampleLimits` bound the claim).

Δ is the update's own tensors for delta and gradient updates and new weights minus the
received global model for weight updates; integer tensors (counters) and ``extras``
are left alone. The attack runs in the client runtime after training and before the
client_send chain, so every server-side defence sees what a real attacker would send.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from fedweave.seeding import torch_generator
from fedweave.types import Params, Update, UpdateKind

UPDATE_ATTACKS = ("sign_flip", "scaling", "noise", "inflate_examples")
DATA_ATTACKS = ("label_flip",)


def scaled(delta: Params, factor: float) -> Params:
    """``factor · delta`` for every floating tensor; integer tensors unchanged."""
    return {k: v * factor if v.is_floating_point() else v for k, v in delta.items()}


def noisy(delta: Params, std: float, generator: torch.Generator) -> Params:
    """``delta`` plus N(0, std²) entries (drawn in float64, in the order of the names) on every floating tensor."""
    out = {}
    for k, v in delta.items():
        if v.is_floating_point():
            noise = torch.randn(v.shape, generator=generator, dtype=torch.float64) * std
            out[k] = (v.double() + noise).to(v.dtype)
        else:
            out[k] = v
    return out


def flipped_labels(y: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Each label ``c`` as ``num_classes − 1 − c``."""
    return num_classes - 1 - y


class Attacker:
    """The attacks ``kinds`` (config ``attacks``) on ``clients``, for a task of ``num_classes`` classes."""

    def __init__(
        self,
        kinds: Sequence[str],
        clients: Sequence[int],
        num_classes: int,
        seed: int,
        scale: float = 1.0,
        std: float = 1.0,
        examples: int = 1_000_000,
    ):
        unknown = [k for k in kinds if k not in UPDATE_ATTACKS + DATA_ATTACKS]
        if unknown:
            raise ValueError(f"unknown attacks {unknown}")
        self.kinds = tuple(kinds)
        self.clients = frozenset(clients)
        self.num_classes = num_classes
        self.seed = seed
        self.scale = scale
        self.std = std
        self.examples = examples

    def labels(self, client_id: int, y: torch.Tensor) -> torch.Tensor:
        """The training labels client ``client_id`` trains on."""
        if "label_flip" in self.kinds and client_id in self.clients:
            return flipped_labels(y, self.num_classes)
        return y

    def update(self, update: Update, start: Params, rnd: int, client_id: int) -> Update:
        """What client ``client_id`` sends in round ``rnd`` instead of ``update``, trained from ``start``:
        each of its attacks on the update applied in the order of ``kinds``."""
        if client_id not in self.clients:
            return update
        weights = update.kind is UpdateKind.WEIGHTS
        delta = {k: v - start[k] if weights and v.is_floating_point() else v for k, v in update.tensors.items()}
        for kind in self.kinds:
            if kind == "sign_flip":
                delta = scaled(delta, -self.scale)
            elif kind == "scaling":
                delta = scaled(delta, self.scale)
            elif kind == "noise":
                delta = noisy(delta, self.std, torch_generator(self.seed, "attack-noise", rnd, client_id))
            elif kind == "inflate_examples":
                update = dataclasses.replace(update, num_examples=self.examples)
        tensors = {k: start[k] + v if weights and v.is_floating_point() else v for k, v in delta.items()}
        return dataclasses.replace(update, tensors=tensors)
