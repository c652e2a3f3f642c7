"""Small builders shared by the plugin tests."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from fedweave.plugins import PLUGINS
from fedweave.plugins.contracts import PluginContext
from fedweave.types import Params, Update, UpdateKind


def make(name: str, clients: int = 10, clients_per_round: int | None = None, seed: int = 0, **params: Any) -> Any:
    """Built-in plugin ``name`` with ``params``, bound to a run of ``clients`` clients."""
    cls = PLUGINS.get(name, "test")
    plugin = cls(cls.HParams(**params))
    if hasattr(plugin, "bind"):
        per_round = clients if clients_per_round is None else clients_per_round
        plugin.bind(SimpleNamespace(seed=seed, clients=clients, clients_per_round=per_round))
    return plugin


def update(tensors: Params, num_examples: int = 10, client_id: int = 0) -> Update:
    return Update(UpdateKind.DELTA, tensors, num_examples, client_id=client_id)


def ctx(rnd: int = 1, client_id: int = 0, side: str = "client") -> PluginContext:
    return PluginContext(rnd, client_id, side)


def model_tensors(seed: int = 0, scale: float = 0.1) -> Params:
    """A small MLP-shaped update with a counter buffer."""
    g = torch.Generator().manual_seed(seed)
    return {
        "features.1.weight": scale * torch.randn(32, 20, generator=g),
        "features.1.bias": scale * torch.randn(32, generator=g),
        "head.weight": scale * torch.randn(4, 32, generator=g),
        "head.bias": scale * torch.randn(4, generator=g),
        "bn.num_batches_tracked": torch.tensor(7),
    }


def roundtrip(plugin: Any, payload: Update, c: PluginContext) -> Update:
    """Encode as the client, decode as the server (what one update goes through)."""
    return plugin.decode(plugin.encode(payload, c), PluginContext(c.round, c.client_id, "server"))
