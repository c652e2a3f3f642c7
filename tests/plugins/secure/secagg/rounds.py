"""Rounds of secure aggregation in this process, shared by the SecAgg tests: clients that
answer the plugin's control steps, a masked round, its unmasked mean, and the secrets the
clients hold."""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import torch

from fedweave.plugins.contracts import PluginContext
from fedweave.plugins.secure.secagg import ClientRound
from fedweave.plugins.secure.secagg.messages import share_bytes
from fedweave.strategies.aggregate import weighted_average
from fedweave.types import Control, Update

from ...helpers import ctx, make, model_tensors, update


class Federation:
    """The clients of a round in this process: each answers the plugin's control steps with
    its own private state, as a client runtime does. ``lost[step]``: clients that answer
    nothing from that step on."""

    def __init__(self, plugin: Any, rnd: int = 1, lost: dict[str, set[int]] | None = None):
        self.plugin, self.round = plugin, rnd
        self.states: dict[int, dict[str, Any]] = {}
        self.lost = lost or {}
        self.gone: set[int] = set()
        self.traffic: list[tuple[str, int, int]] = []  # step, messages sent, answers

    def ctx(self, u: int) -> PluginContext:
        """Client u's context, with the config the server's half gives its training instruction (whom it masks with)."""
        config = self.plugin.instruct(PluginContext(self.round, u, "server"))
        return PluginContext(self.round, u, "client", self.states.setdefault(u, {}), config)

    def exchange(self, bodies: dict[int, Control]) -> dict[int, Control]:
        step = next(iter(bodies.values())).step if bodies else "-"
        self.gone |= self.lost.get(step, set())
        answers = {u: self.plugin.answer(b, self.ctx(u)) for u, b in bodies.items() if u not in self.gone}
        self.traffic.append((step, len(bodies), len(answers)))
        return answers


def masked_round(n: int, rnd: int = 1, seed: int = 0, lost: dict[str, set[int]] | None = None, **params: Any) -> tuple:
    """n clients of a round: the plugin after set-up, the clients, their plaintext updates,
    the masked updates of the clients set up (and not lost before masking)."""
    plugin = make("secagg", clients=n, **params)
    fed = Federation(plugin, rnd, lost)
    ready = plugin.setup(rnd, list(range(n)), fed.exchange)
    fed.gone |= (lost or {}).get("train", set())
    plain = [update(model_tensors(seed + i, scale=0.5), num_examples=10 + 7 * i, client_id=i) for i in range(n)]
    masked = [plugin.encode(u, fed.ctx(u.client_id)) for u in plain if u.client_id in ready and u.client_id not in fed.gone]
    return plugin, fed, plain, masked


def unmask(plugin: Any, fed: Federation, masked: list[Update]) -> dict[str, torch.Tensor]:
    server = ctx(fed.round, -1, "server")
    return plugin.decode(plugin.combine(masked, server, fed.exchange), server).tensors


def assert_mean_within_quantization(result: dict, plain: list, plugin: Any) -> None:
    expected = weighted_average([u.tensors for u in plain], [u.num_examples for u in plain])
    step = 2 * plugin.hp.clip_range / plugin.levels  # one quantization step of a single update
    assert result.keys() == expected.keys()
    for k, v in expected.items():
        if v.is_floating_point():
            assert (result[k] - v).abs().max().item() <= step
            assert result[k].dtype == v.dtype
        else:
            assert torch.equal(result[k], v)


def secret_values(states: dict[int, dict[str, Any]]) -> tuple[list[Any], list[bytes]]:
    """The X25519 private keys and the secret byte strings (seeds, keys, shares) clients hold now."""
    keys, values = [], []
    for state in states.values():
        mine = state.get("secagg")
        if not isinstance(mine, ClientRound):
            continue
        if mine.key is not None:
            keys.append(mine.key)
            values.append(mine.key.private_bytes_raw())
        values += [v for v in (mine.self_seed, mine.record_key) if v is not None]
        values += [*mine.seeds.values(), *mine.channels.values()]
        values += [share_bytes([(v, 0)])[:32] for pairs in mine.shares.values() for pair in pairs for v in pair]
    return keys, values


def reachable(root: Any) -> list[Any]:
    """Every object reachable from ``root`` through attributes and containers."""
    seen, todo, out = set(), [root], []
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (type, type(reachable))) or getattr(obj, "__module__", "") == "functools":
            continue
        seen.add(id(obj))
        out.append(obj)
        todo.extend(gc.get_referents(obj))
    return out


def assert_holds_none(root: Any, keys: list[Any], values: list[bytes]) -> None:
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    objects = reachable(root)
    assert not [o for o in objects if isinstance(o, X25519PrivateKey)]
    assert not {id(k) for k in keys} & {id(o) for o in objects}
    blobs = [bytes(o) for o in objects if isinstance(o, (bytes, bytearray))]
    blobs += [o.tobytes() for o in objects if isinstance(o, np.ndarray) and o.size]
    blobs += [o.to_bytes(32, "big") for o in objects if type(o) is int and 1 << 64 < o < 1 << 256]  # shares in GF(Q)
    assert not [v for v in values for b in blobs if v in b]
