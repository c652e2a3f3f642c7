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
from fedweave.plugins.compression.wire import DELTA, FORMAT, Site, tensor_seeds
from fedweave.plugins.compression.wire import MODEL as MARKED
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


CODECS = [("quantize", {"dtype": "bfloat16"}), ("topk", {"ratio": 0.5}), ("powersgd", {"rank": 1})]


def models(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [{"w": torch.randn(6, 4, generator=g), "b": torch.randn(4, generator=g), "n": torch.tensor(r)} for r in range(n)]


def halves(name: str, **params: object) -> tuple:
    """A server's and a client's plugin, the server's encoding of round r's model, the client's decoding."""
    server, client = make(name, **params), make(name, **params)
    rounds = models(6)
    expected = UpdateSchema.of(rounds[0]).tensors

    def send(rnd: int) -> Instruction:
        return server.encode(Instruction(rnd, TaskKind.TRAIN, Work(0, 8), rounds[rnd]), PluginContext(rnd, 0, "server"))

    def receive(sent: Instruction) -> dict[str, torch.Tensor]:
        return client.decode(sent, PluginContext(sent.round, 0, "client", expected=expected)).params

    return server, client, send, receive


@pytest.mark.parametrize("name,params", CODECS)
def test_a_difference_against_a_model_the_client_does_not_hold_is_refused_with_the_reason(name: str, params: dict) -> None:
    """Round 2's broadcast is encoded but never decoded (its job failed: a deadline, a broken stream),
    or one broadcast is decoded twice: the server's copy of the client's model and the client's part.
    Before the broadcasts named their models, the client decoded round 3's difference against the wrong
    model, silently (3.6 off in bfloat16); now it refuses it, naming both models, and keeps its own."""
    server, client, send, receive = halves(name, **params)
    receive(send(1))
    send(2)  # lost
    held = {k: v.clone() for k, v in client.held[0].items()}
    third = send(3)
    with pytest.raises(ValueError, match=r"a difference of model [0-9a-f]+, but client 0 holds model [0-9a-f]+ "
                                         r"\(a broadcast it never decoded, or decoded twice"):
        receive(third)
    assert all(torch.equal(client.held[0][k], v) for k, v in held.items())

    server, client, send, receive = halves(name, **params)
    receive(send(1))
    second = send(2)
    receive(second)
    with pytest.raises(ValueError, match="but client 0 holds model"):
        receive(second)  # decoded twice
    assert receive(send(3)).keys() == models(1)[0].keys()  # the honest next one still decodes, against its model


@pytest.mark.parametrize("name,params", CODECS)
def test_a_client_whose_job_failed_gets_the_dense_model_and_the_copies_agree_again(name: str, params: dict) -> None:
    """A refusal fails the client's job; told of it (``failed``), the server sends that client the dense
    model next, and the differences after it decode to the server's copy again, to the bit."""
    server, client, send, receive = halves(name, **params)
    receive(send(1))
    send(2)  # lost
    with pytest.raises(ValueError, match="but client 0 holds"):
        receive(send(3))
    server.failed({0: "ValueError: plugin: refused"})
    fourth = send(4)
    assert DELTA not in fourth.params and MARKED in fourth.params
    assert all(torch.equal(v, models(6)[4][k]) for k, v in receive(fourth).items())
    fifth = send(5)
    assert DELTA in fifth.params
    got = receive(fifth)
    assert all(torch.equal(got[k], server.sent[0][k]) for k in got)


def test_a_client_that_restarted_refuses_a_difference_and_another_client_s_failure_changes_nothing() -> None:
    server, client, send, receive = halves("quantize", dtype="bfloat16")
    receive(send(1))
    server.failed({3: "lost"})  # not this client
    second = send(2)
    assert DELTA in second.params
    restarted = make("quantize", dtype="bfloat16")
    with pytest.raises(ValueError, match="but client 0 holds no model"):
        restarted.decode(second, PluginContext(2, 0, "client", expected=UpdateSchema.of(models(1)[0]).tensors))


@pytest.mark.parametrize("marker", [
    torch.tensor([FORMAT, 1, 2], dtype=torch.int32),  # not int64
    torch.tensor([[FORMAT, 1, 2]]),  # not a vector
    torch.tensor([FORMAT, 1]),  # too short
    torch.tensor([FORMAT, 1, 2, 3]),  # too long
    torch.tensor([FORMAT + 1, 1, 2]),  # another format
    torch.tensor([FORMAT, -1, 2]),  # not an id
    torch.tensor([1.0, 1.0, 2.0]),
])
def test_a_malformed_delta_marker_is_refused_before_anything_is_decoded(marker: torch.Tensor) -> None:
    server, client, send, receive = halves("topk", ratio=0.5)
    receive(send(1))
    second = send(2)
    held = {k: v.clone() for k, v in client.held[0].items()}
    with pytest.raises(ValueError, match=f"a broadcast whose '{DELTA}' (is|names)"):
        receive(replace(second, params={**second.params, DELTA: marker}))
    assert all(torch.equal(client.held[0][k], v) for k, v in held.items())


def test_a_malformed_model_marker_is_refused() -> None:
    server, client, send, receive = halves("topk", ratio=0.5)
    first = send(1)
    for marker in (torch.tensor([FORMAT, 1, 2]), torch.tensor([FORMAT + 1, 1]), torch.tensor([FORMAT, 1], dtype=torch.int8)):
        with pytest.raises(ValueError, match=f"a broadcast whose '{MARKED}' is"):
            receive(replace(first, params={**first.params, MARKED: marker}))
    assert 0 not in client.held
    assert MARKED not in receive(first)


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
