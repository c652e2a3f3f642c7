"""What every compression plugin shares, against hostile peers: a compressed broadcast must
decode to a difference of the model the client holds, tensor for tensor; the fields a summable
compressor leaves in a client's update for secure aggregation are checked on receipt."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

from fedweave.plugins.chain import Chain, Chains
from fedweave.plugins.contracts import PluginContext
from fedweave.plugins.compression.wire import Site, tensor_seeds
from fedweave.plugins.contracts import Plugin
from fedweave.types import Instruction, Message, TaskKind, Update, Work
from fedweave.federated.checks import Rejected, UpdateChecks, UpdateSchema
from fedweave.federated.receive import receive

from ..helpers import make, update
from ..secure.secagg.rounds import Federation

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


def masked_round(compressor: Plugin) -> tuple[Chains, Federation, list[Update], PluginContext]:
    """Three clients of a SecAgg round after the compressor (the server's chain), their masked updates."""
    secagg = make("secagg", clients=3)
    fed = Federation(secagg)
    secagg.setup(1, [0, 1, 2], fed.exchange)
    g = torch.Generator().manual_seed(0)
    masked = []
    for cid in range(3):
        model = {"w": torch.randn(40, generator=g).clamp(-1, 1), "b": torch.randn(8, generator=g).clamp(-1, 1)}
        encoded = compressor.encode(update(model, client_id=cid), fed.ctx(cid))
        masked.append(replace(secagg.encode(encoded, fed.ctx(cid)), applied=[compressor.name, "secagg"]))
    expected = UpdateSchema.of(model).tensors
    return Chains(client_send=Chain([compressor, secagg])), fed, masked, PluginContext(1, -1, "server", expected=expected)


@pytest.mark.parametrize("name,params,key,value,reason", [
    ("randk", {"ratio": 0.25, "shared_indices": True}, "w.__values.__flat", torch.tensor([0, 2], dtype=torch.int32),
     "'values' hold 2 entries, the layout's tensor sends 10"),
    ("randk", {"ratio": 0.25, "shared_indices": True}, "w.__seed", torch.tensor([1, 2]), "'seed' hold 2 entries"),
    ("randk", {"ratio": 0.25, "shared_indices": True}, "w.__seed", None, "field 'seed' is missing"),
    ("randk", {"ratio": 0.25, "shared_indices": True}, "w.__values.__flat", torch.tensor([1, 10], dtype=torch.int32),
     "field 'values' of 'w' is torch.float64"),
    ("randk", {"ratio": 0.25, "shared_indices": True}, "w.__values.__flat", torch.tensor([0, 2, 5], dtype=torch.int32),
     "'values' is of shape (2, 5), not a vector"),
    ("quantize", {"dtype": "float16"}, "b.__values.__flat", torch.tensor([2, 4, 2], dtype=torch.int32),
     "'values' is of shape (4, 2), the layout's tensor (8,)"),
    ("quantize", {"dtype": "float16"}, "b.__layout", None, "the update encodes ['b', 'w'], not the model's"),
])
def test_a_field_left_in_the_summed_vector_not_as_the_compressor_sends_it_is_refused_alone_on_receipt(
    name: str, params: dict, key: str, value: torch.Tensor | None, reason: str
) -> None:
    """Before SecAgg a summable compressor's floating fields travel in the summed vector (their
    layouts in the clear, ``w.__values.__flat``) and its integers in the clear (random-k's seed),
    combined by their maximum. One client's other layout or seed made the round's combine raise
    (the clients disagree, or a maximum of tensors of other shapes), which ended the run; it is
    refused on receipt, and the others combine."""
    chains, fed, masked, server = masked_round(make(name, **params))
    forged = {k: v for k, v in masked[2].tensors.items() if k != key}
    if value is not None:
        forged[key] = value
    schema = UpdateSchema(server.expected or {})
    with pytest.raises(Rejected, match=re.escape(reason)):  # the receive pipeline's sums step
        receive(chains, Message(1, 2, replace(masked[2], tensors=forged)), schema, UpdateChecks(), {2}, ())
    accepted = [receive(chains, Message(1, m.client_id, m), schema, UpdateChecks(), {m.client_id}, ()).update
                for m in masked[:2]]
    combined = chains.combine(accepted, server, fed.exchange)
    assert combined.tensors["w"].shape == (40,) and combined.tensors["b"].shape == (8,)


def test_each_tensors_seed_is_its_sites_whether_the_sites_share_a_payload_or_not() -> None:
    one = [Site("qsgd", 5, "up", 3, 2, name) for name in ("w", "b", "0.weight")]
    mixed = [*one, Site("qsgd", 5, "down", 3, 2, "w"), Site("qsgd", 5, "up", 4, 2, "w")]
    for sites in (one, mixed, one[:1], []):
        assert tensor_seeds(sites) == [site.seed_for(site.client_id, site.name) for site in sites]
    assert len(set(tensor_seeds(mixed))) == 5
