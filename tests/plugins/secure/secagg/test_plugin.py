"""The secagg plugin, both halves together: the message flow, the sum within quantization
error, drop-outs at every step, a late update's self mask, and whole runs (equal to plain
FedAvg, with drop-outs, with client secrets kept in the runtime)."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from conftest import assert_same_params, run_to_end, small_config
from fedweave import runner
from fedweave.errors import RoundError
from fedweave.plugins.contracts import PluginContext
from fedweave.plugins.secure.secagg import MASKED, SEALED_SHARES
from fedweave.transports.base import Exchange
from fedweave.types import Control, Message, Update

from ...helpers import ctx, make, model_tensors, update
from .rounds import Federation, assert_holds_none, assert_mean_within_quantization, masked_round, secret_values, unmask


def test_the_message_flow_and_the_sum_equals_the_plaintext_weighted_mean() -> None:
    plugin, fed, plain, masked = masked_round(5)
    assert fed.traffic == [("advertise", 5, 5), ("share", 5, 5), ("forward", 5, 5)]
    assert_mean_within_quantization(unmask(plugin, fed, masked), plain, plugin)
    assert fed.traffic[-1] == ("unmask", 5, 5)
    assert all(set(m.tensors) >= {MASKED} and m.tensors[MASKED].dtype == torch.int32 for m in masked)
    assert fed.states == {u: {} for u in range(5)}  # every client dropped its secrets after unmasking


def test_ten_clients_threshold_six_three_drop_after_masking_the_survivors_sum_is_recovered() -> None:
    plugin, fed, plain, masked = masked_round(10, threshold=0.6)
    assert plugin.round.threshold[0] == 6
    survivors = [m for m in masked if m.client_id not in (2, 5, 9)]
    result = unmask(plugin, fed, survivors)
    assert_mean_within_quantization(result, [u for u in plain if u.client_id not in (2, 5, 9)], plugin)
    assert fed.traffic[-1] == ("unmask", 7, 7)  # only survivors are asked


def test_ten_clients_threshold_six_five_drop_the_round_aborts() -> None:
    plugin, fed, _, masked = masked_round(10, threshold=0.6)
    with pytest.raises(RoundError, match=r"only 5 of client 5's share holders survived, its self-mask seed needs 6"):
        plugin.combine(masked[5:], ctx(1, -1, "server"), fed.exchange)
    assert fed.traffic[-1][0] == "forward"  # aborted before asking anyone for a share


def test_four_of_ten_drop_after_masking_each_survivor_holds_exactly_the_threshold() -> None:
    """n = 10, t = 6: each of the 6 survivors and its 5 surviving neighbours make exactly 6 holders."""
    plugin, fed, plain, masked = masked_round(10, threshold=0.6)
    survivors = [m for m in masked if m.client_id not in (1, 4, 6, 8)]
    result = unmask(plugin, fed, survivors)
    assert_mean_within_quantization(result, [u for u in plain if u.client_id not in (1, 4, 6, 8)], plugin)


@pytest.mark.parametrize(
    ("lost", "trained"),
    [
        ({"advertise": {3}}, [0, 1, 2, 4, 5, 6, 7]),  # before step 1: not in the round at all
        ({"share": {3}}, [0, 1, 2, 4, 5, 6, 7]),  # shared nothing: nobody masks with it
        ({"forward": {3}}, [0, 1, 2, 4, 5, 6, 7]),  # shared, never trained: its masks are removed
        ({"train": {3, 6}}, [0, 1, 2, 4, 5, 7]),  # masked nothing: its masks are removed
        ({"unmask": {3}}, [0, 1, 2, 3, 4, 5, 6, 7]),  # its update counts; others rebuild its self mask
    ],
)
def test_a_client_lost_at_any_step_is_excluded_or_recovered(lost: dict[str, set[int]], trained: list[int]) -> None:
    plugin, fed, plain, masked = masked_round(8, lost=lost, neighbours=4)
    assert [m.client_id for m in masked] == trained
    assert_mean_within_quantization(unmask(plugin, fed, masked), [plain[u] for u in trained], plugin)


def test_a_client_whose_neighbours_did_not_share_leaves_before_anyone_masks_with_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    plugin = make("secagg", clients=10, neighbours=4)  # t = 3 of 5: two neighbours must share
    lonely = 0
    lost = set(plugin.graph(1, list(range(10)))[lonely][:3])
    with caplog.at_level(logging.WARNING):
        plugin, fed, plain, masked = masked_round(10, lost={"share": lost}, neighbours=4)
    trained = [m.client_id for m in masked]
    assert lonely not in trained and not lost & set(trained) and len(trained) >= 2
    thinned = [r.getMessage() for r in caplog.records if "too few neighbours shared" in r.getMessage()]
    assert thinned and all(re.fullmatch(r"round 1: clients \[\d+(, \d+)*\] leave secure aggregation: too few neighbours shared", m) for m in thinned)
    assert thinned[0].startswith(f"round 1: clients [{lonely}")
    assert_mean_within_quantization(unmask(plugin, fed, masked), [plain[u] for u in trained], plugin)


def test_too_few_holders_answering_the_unmasking_abort_the_round() -> None:
    plugin, fed, _, masked = masked_round(5, lost={"unmask": {0, 1, 2}})
    with pytest.raises(RoundError, match=r"only 2 of client 0's share holders answered, its self-mask seed needs 3"):
        plugin.combine(masked, ctx(1, -1, "server"), fed.exchange)


def test_an_update_without_set_up_or_from_outside_the_cohort_is_refused() -> None:
    plugin, fed, plain, _ = masked_round(3)
    with pytest.raises(ValueError, match="client 7 has no secure-aggregation set-up for round 1"):
        plugin.encode(update(model_tensors(), client_id=7), fed.ctx(7))
    with pytest.raises(ValueError, match="no secure-aggregation set-up for round 2"):
        plugin.encode(plain[0], PluginContext(2, 0, "client", fed.states[0]))
    with pytest.raises(ValueError, match="client 0 has no secure-aggregation set-up for round 1"):
        plugin.encode(plain[0], ctx(1, 0))  # no private state at all
    fresh = make("secagg", clients=3)
    clients = Federation(fresh)
    fresh.setup(1, [0, 1, 2], clients.exchange)
    for value in (float("nan"), float("inf")):
        bad = update({"w": torch.tensor([0.5, value])}, client_id=1)
        with pytest.raises(ValueError, match="client 1's update holds NaN or infinite values; it is not masked"):
            fresh.encode(bad, clients.ctx(1))
    with pytest.raises(ValueError, match=r"^secagg's client half needs the client's private state \(ctx.state\)$"):
        plugin.answer(Control("secagg", "advertise"), ctx(1, 0))
    with pytest.raises(RoundError, match="no key set-up for round 1"):
        make("secagg", clients=3).combine([], ctx(1, -1, "server"), fed.exchange)  # never set up
    with pytest.raises(RoundError, match="no key set-up for round 2"):
        plugin.combine([], ctx(2, -1, "server"), fed.exchange)


def test_an_update_without_floating_tensors_is_masked_and_summed() -> None:
    plugin = make("secagg", clients=3)
    fed = Federation(plugin)
    plugin.setup(1, [0, 1, 2], fed.exchange)
    counters = [update({"n": torch.tensor(3 + u)}, client_id=u) for u in range(3)]
    masked = [plugin.encode(u, fed.ctx(u.client_id)) for u in counters]
    server = ctx(1, -1, "server")
    assert plugin.decode(plugin.combine(masked, server, fed.exchange), server).tensors["n"].item() == 5


@pytest.mark.parametrize("bits", [32, 24])
def test_a_full_round_at_the_range_ends_does_not_wrap_the_field(bits: int) -> None:
    """max_examples examples, every entry at ±R (level L or 0): Σ n·L = max_examples·L < 2^bits, exactly."""
    plugin = make("secagg", clients=2, max_examples=64, bits=bits)
    fed = Federation(plugin)
    plugin.setup(1, [0, 1], fed.exchange)
    ends = [update({"w": torch.tensor([4.0, -4.0, 9.0])}, num_examples=32, client_id=u) for u in range(2)]
    result = unmask(plugin, fed, [plugin.encode(u, fed.ctx(u.client_id)) for u in ends])["w"]
    assert result.tolist() == [4.0, -4.0, 4.0]


def test_a_late_update_stays_hidden_by_its_self_mask_after_its_pair_masks_are_removed() -> None:
    """Bonawitz et al.'s reason for b_u: client 0's masked update arrives too late, so the
    round treats it as dropped and the survivors reveal its record key; the server opens its
    seed record and strips every pairwise mask from the late y_0. What is left must still be
    uniform, independent of n_0·x_0: only the self mask PRG(b_0), whose shares it never gets
    (each client reveals one secret per owner), hides it."""
    from fedweave.plugins.secure.secagg.keys import associated_data, open_sealed, sender_nonce
    from fedweave.plugins.secure.secagg.server import _chunks

    plugin, fed, plain, masked = masked_round(6, bits=32)
    late = masked[0]
    answers: dict[int, Control] = {}

    def spying(bodies: dict[int, Control]) -> dict[int, Control]:
        out = fed.exchange(bodies)
        answers.update(out)
        return out

    server = ctx(1, -1, "server")
    result = plugin.decode(plugin.combine(masked[1:], server, spying), server).tensors
    assert_mean_within_quantization(result, plain[1:], plugin)  # the round went on without client 0
    setup = plugin.round
    alive = set(range(1, 6))
    asked = {v: [w for w in setup.neighbours[v] if w in alive] for v in alive}
    gone = {v: [w for w in setup.neighbours[v] if w == 0] for v in alive}
    seeds, keys = plugin._collect(1, answers, asked, gone)
    assert 0 not in seeds  # nobody revealed a share of b_0
    record = open_sealed(
        plugin._recover(1, 0, keys[0], True, set()), sender_nonce(0), setup.records[0], associated_data("seeds", 1, 0, 0), "record"
    )
    stripped = plugin.field.from_wire(late.tensors[MASKED]).copy()
    with plugin.field.workspace(stripped.size) as (stream, _):
        for v, seed in zip(setup.neighbours[0], _chunks(record)):
            plugin.field.add_mask(stripped, seed, stream, subtract=v > 0)  # client 0 added PRG(s_0v) for v > 0
    values = plugin.field.reduce(stripped).astype(np.float64) / 2**32
    x = torch.cat([t.reshape(-1) for t in plain[0].tensors.values() if t.is_floating_point()]).numpy()
    counts = np.histogram(values, bins=16, range=(0, 1))[0]
    assert ((counts - len(values) / 16) ** 2 / (len(values) / 16)).sum() < 56.5  # χ², 15 degrees of freedom, p = 1e-6
    assert abs(np.corrcoef(values, x)[0, 1]) < 4 / np.sqrt(len(x))


def test_a_run_keeps_client_secrets_in_the_runtime_only(tmp_path: Path) -> None:
    r = runner.prepare(small_config("rounds=1", "plugins.client_send=[secagg]"), tmp_path / "run")
    runtime = r.parts.topology.transport.handler.__self__
    seen: list[int] = []

    class Watch:
        def exchange(self, messages, timeout):  # type: ignore[no-untyped-def]
            if messages and isinstance(messages[0].body, Control) and messages[0].body.step == "unmask":
                keys, values = secret_values(runtime.plugin_state)
                assert keys == [] and values  # after masking: only shares are left
                assert_holds_none(r.parts.chains, keys, values)
                seen.append(len(runtime.plugin_state))
            return inner.exchange(messages, timeout)

        def close(self) -> None:
            inner.close()

    inner, r.parts.topology = r.parts.topology, Watch()
    records = runner.execute(r)
    assert seen == [4] and runtime.plugin_state == {} and not records[0]["skipped"]


def control_bytes(n: int, k: int, t: int) -> tuple[int, int]:
    """Hand count of one round's key and share traffic with n clients, each with k neighbours and
    threshold t: (server to clients, clients to server) bytes of tensor data."""
    commitments = 2 * t * 256  # a dealer's: t group elements of 2048 bits for each of its two secrets
    sent = n * (4 * n + 32 * k)  # share: the cohort (int32) and k public keys
    sent += n * (4 * k + SEALED_SHARES * k + commitments * k)  # forward: k senders (int32), their sealed shares, commitments
    sent += n * 4 * k  # unmask: the k survivors
    received = n * 32  # advertise: a public key
    received += n * (16 * k + 16 + SEALED_SHARES * k + commitments)  # share: the seed record, k sealed shares, commitments
    received += 0  # forward: the senders whose shares it refused, none
    received += n * 64 * (k + 1)  # unmask: k + 1 shares of self-mask seeds, each a value and a blinding of 32 bytes
    return sent, received


def test_a_secagg_run_equals_plain_fedavg_within_quantization_and_counts_its_traffic(tmp_path: Path) -> None:
    plain, plain_records = run_to_end(tmp_path / "plain")
    secure, records = run_to_end(tmp_path / "secure", "plugins.client_send=[{name: secagg, bits: 48}]")
    assert_same_params(plain, secure, atol=1e-5)
    assert all(not r["skipped"] for r in records)
    sent, received = control_bytes(4, 3, 3)
    layouts = 4 * 4 * 10  # per client, each tensor's layout: [dtype, *shape] as int32
    for p, s in zip(plain_records, records):
        assert s["bytes_sent"] == p["bytes_sent"] + sent
        assert s["bytes_received"] == 2 * p["bytes_received"] + layouts + received  # int64 entries: 8 bytes


class DropAfterMasking:
    """A topology whose replies from some clients are lost after the clients masked them."""

    def __init__(self, inner: Any, lost: set[int]):
        self.inner, self.lost = inner, lost

    def exchange(self, messages, timeout):  # type: ignore[no-untyped-def]
        result = self.inner.exchange(messages, timeout)
        kept = Exchange(bytes_sent=result.bytes_sent, bytes_received=result.bytes_received, failures=result.failures)
        for reply in result.replies:
            if reply.client_id in self.lost and reply.round == 1 and isinstance(reply.body, Update):
                kept.failures[reply.client_id] = "connection lost"
            else:
                kept.replies.append(reply)
        return kept

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize("lost,skipped", [({1, 4, 8}, False), ({0, 2, 4, 6, 8}, True)])
def test_in_a_run_drop_outs_are_recovered_or_skip_the_round(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, lost: set[int], skipped: bool
) -> None:
    config = small_config("clients=10", "rounds=2", "plugins.client_send=[{name: secagg, threshold: 0.6}]")
    r = runner.prepare(config, tmp_path / "run")
    r.parts.topology = DropAfterMasking(r.parts.topology, lost)
    start = {k: v.clone() for k, v in r.params.items()}
    with caplog.at_level(logging.ERROR):
        records = runner.execute(r)
    assert records[0]["skipped"] is skipped and records[0]["clients_completed"] == 10 - len(lost)
    assert records[1]["skipped"] is False
    if skipped:
        assert "round 1 skipped: secagg: only 5 of client" in caplog.text
    moved = any(not torch.equal(start[k], v) for k, v in r.params.items())
    assert moved  # round 2 always trains


def test_in_a_run_a_client_failing_the_set_up_does_not_train(tmp_path: Path) -> None:
    r = runner.prepare(small_config("clients=5", "rounds=1", "plugins.client_send=[secagg]"), tmp_path / "run")
    trained: list[int] = []
    handle = r.parts.topology.transport.handler

    def flaky(msg):  # type: ignore[no-untyped-def]
        if isinstance(msg.body, Control) and msg.body.step == "share" and msg.client_id == 2:
            raise ConnectionError("link down")
        if not isinstance(msg.body, Control):
            trained.append(msg.client_id)
        return handle(msg)

    r.parts.topology.transport.handler = flaky
    records = runner.execute(r)
    assert trained == [0, 1, 3, 4]
    assert records[0]["clients_completed"] == 4 and not records[0]["skipped"]


def test_a_masked_update_whose_clear_layout_is_not_the_model_s_is_refused_alone() -> None:
    """A client that forges the layout carried in the clear (here 'w' as 2^20 values) is refused on
    receipt, before the round's combine, where it would make the clients disagree and fail the round."""
    import dataclasses

    from fedweave.plugins.chain import Chain, Chains
    from fedweave.plugins.packing import FLAT, SEP, layout
    from fedweave.federated.checks import Rejected, UpdateChecks, UpdateSchema
    from fedweave.federated.receive import receive

    plugin, fed, plain, masked = masked_round(3)
    chains = Chains(client_send=Chain([plugin]))
    expected = UpdateSchema.of(plain[0].tensors).tensors
    masked = [dataclasses.replace(m, applied=["secagg"]) for m in masked]  # as the client's chain marks them
    schema = UpdateSchema(expected)
    for m in masked:  # the honest ones pass
        receive(chains, Message(1, m.client_id, m), schema, UpdateChecks(), {m.client_id}, ())
    name = next(k for k in plain[0].tensors if plain[0].tensors[k].is_floating_point())
    forged = Update(masked[0].kind, {**masked[0].tensors, f"{name}{SEP}{FLAT}": layout(torch.zeros(1 << 20))},
                    masked[0].num_examples, client_id=0, applied=list(masked[0].applied))
    with pytest.raises(Rejected, match=f"the layout of '{name}' is torch.float32 \\(1048576,\\)"):
        receive(chains, Message(1, 0, forged), schema, UpdateChecks(), {0}, ())  # the receive pipeline's layouts step
