"""What every compression plugin shares, against a hostile server: a compressed broadcast
must decode to a difference of the model the client holds, tensor for tensor."""

from __future__ import annotations

import pytest
import torch

from fedweave.plugins.chain import PluginContext
from fedweave.types import Instruction, TaskKind, Work
from fedweave.validation import UpdateSchema

from ..helpers import make

MODEL = {"w": torch.arange(8.0), "b": torch.ones(3), "n": torch.tensor(4)}


def broadcasts(name: str, **params: object) -> tuple:
    """The client's plugin holding round 1's dense model, the server's round-2 broadcast (a compressed difference)."""
    server, client = make(name, **params), make(name, **params)
    first = server.encode(Instruction(1, TaskKind.TRAIN, Work(0, 8), MODEL), PluginContext(1, 0, "server"))
    client.decode(first, PluginContext(1, 0, "client", expected=UpdateSchema.of(MODEL).tensors))
    moved = {k: v + 1 for k, v in MODEL.items()}
    second = server.encode(Instruction(2, TaskKind.TRAIN, Work(0, 8), moved), PluginContext(2, 0, "server"))
    return client, second, PluginContext(2, 0, "client", expected=UpdateSchema.of(MODEL).tensors)


@pytest.mark.parametrize("name,params", [("topk", {"ratio": 0.5}), ("quantize", {"dtype": "int8", "bucket": 4})])
def test_a_broadcast_not_a_difference_of_the_held_model_is_refused_and_the_model_kept(name: str, params: dict) -> None:
    """The honest broadcast moves the held model by one; a broadcast lacking a tensor (a KeyError
    from deep in the decode), or sending a tensor plain in a shape that broadcasts against the held
    one (the held model grew to 5 x 8 entries), is refused with a reason and the held model kept."""
    client, second, ctx = broadcasts(name, **params)
    held = {k: v.clone() for k, v in client.held[0].items()}
    rest = {k: v for k, v in second.params.items() if not k.startswith("w.")}
    for forged in (rest, {**rest, "w": torch.ones(5, 8)}, {**rest, "w": torch.ones(8, dtype=torch.float64)}):
        with pytest.raises(ValueError, match="not a difference of the model client 0 holds"):
            client.decode(Instruction(2, TaskKind.TRAIN, Work(0, 8), forged), ctx)
        assert all(torch.equal(client.held[0][k], v) and client.held[0][k].shape == v.shape for k, v in held.items())
    got = client.decode(second, ctx).params
    assert torch.equal(got["n"], torch.tensor(5)) and got["w"].shape == (8,) and got["b"].shape == (3,)
