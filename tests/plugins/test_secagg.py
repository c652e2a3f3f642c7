"""Secure aggregation: Shamir sharing, the message flow, the sum within quantization error,
masking, drop-outs at every step, and the secrets each side holds."""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import math
import re
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from conftest import assert_same_params, run_to_end, small_config
from fedweave import runner
from fedweave.errors import ConfigError, RoundError, SerializationError
from fedweave.plugins.chain import PluginContext
from fedweave.plugins.secure import shamir
from fedweave.plugins.secure.secagg import MASKED, SEALED_SHARES, ClientRound, Quantizer, hkdf
from fedweave.strategies.aggregate import weighted_average
from fedweave.transports import serialization as ser
from fedweave.transports.base import Exchange
from fedweave.types import Control, Message, Update

from .helpers import ctx, make, model_tensors, update

# --------------------------------------------------------------------------- Shamir, HKDF


def test_shamir_recovers_from_any_threshold_of_shares_and_not_fewer() -> None:
    secrets = [bytes(range(32)), bytes(range(100, 132))]
    limbs = shamir.to_limbs(secrets)
    assert limbs.shape == (2, 16) and limbs[0, 0] == 0x0001 and limbs[1, 15] == (130 << 8) + 131
    xs = list(range(1, 8))
    shares = shamir.split(limbs, 4, xs)
    assert shares.shape == (7, 2, 16) and shares.max() < shamir.PRIME
    for subset in ([0, 1, 2, 3], [6, 4, 2, 0], [1, 3, 5, 6, 4]):
        assert shamir.from_limbs(shamir.combine([xs[i] for i in subset], shares[subset])) == secrets
    fewer = shamir.combine(xs[:3], shares[:3])
    assert not np.array_equal(fewer, limbs)  # three points of a cubic say nothing of f(0)


def test_shamir_by_hand_over_the_prime_field() -> None:
    # f(x) = 5 + 3x over GF(p): shares f(1) = 8, f(2) = 11; Lagrange at 0: 2·8 − 1·11 = 5
    assert shamir.lagrange_at_zero([1, 2]).tolist() == [2, shamir.PRIME - 1]
    assert shamir.combine([1, 2], np.array([[8], [11]])).tolist() == [5]
    with pytest.raises(ValueError, match="inconsistent"):
        shamir.from_limbs(np.array([[1 << 16]]))


def test_t_minus_one_shares_are_uniform_whatever_the_secret() -> None:
    """With threshold 2, one share is a uniform value independent of the secret."""
    draws = np.concatenate([shamir.split(np.array([s] * 4000), 2, [3, 5])[0] for s in (0, 65535)])
    counts = np.histogram(draws, bins=8, range=(0, shamir.PRIME))[0]
    assert ((counts - 1000) ** 2 / 1000).sum() < 24.3  # chi-square, 7 degrees of freedom, p = 0.001


def test_hkdf_is_rfc5869_sha256() -> None:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    secret = bytes(range(32))
    ours = hkdf(secret, b"one", b"two")
    for info, key in zip((b"one", b"two"), ours):
        assert key == HKDF(hashes.SHA256(), 32, salt=None, info=info).derive(secret)
    assert ours[0] != ours[1]


# --------------------------------------------------------------------------- one round, plugin level


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
        return PluginContext(self.round, u, "client", self.states.setdefault(u, {}))

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


def test_the_message_flow_and_the_sum_equals_the_plaintext_weighted_mean() -> None:
    plugin, fed, plain, masked = masked_round(5)
    assert fed.traffic == [("advertise", 5, 5), ("share", 5, 5), ("forward", 5, 5)]
    assert_mean_within_quantization(unmask(plugin, fed, masked), plain, plugin)
    assert fed.traffic[-1] == ("unmask", 5, 5)
    assert all(set(m.tensors) >= {MASKED} and m.tensors[MASKED].dtype == torch.int32 for m in masked)
    assert fed.states == {u: {} for u in range(5)}  # every client dropped its secrets after unmasking


def test_secagg_plus_neighbourhoods_are_symmetric_and_sparse() -> None:
    plugin = make("secagg", neighbours=4, clients=30)
    graph = plugin.graph(3, list(range(30)))
    assert all(len(nb) == 4 and u not in nb for u, nb in graph.items())
    assert all(u in graph[v] for u, nb in graph.items() for v in nb)
    assert graph != plugin.graph(4, list(range(30)))  # a new random ring every round
    plugin, fed, plain, masked = masked_round(12, neighbours=4)
    assert_mean_within_quantization(unmask(plugin, fed, masked), plain, plugin)


def test_a_masked_update_is_uniform_and_uncorrelated_with_the_plaintext() -> None:
    plugin, fed, plain, masked = masked_round(4, bits=32)
    field = plugin.field
    values = field.from_wire(masked[0].tensors[MASKED]).astype(np.float64) / 2**32
    x = torch.cat([t.reshape(-1) for t in plain[0].tensors.values() if t.is_floating_point()]).numpy()
    counts = np.histogram(values, bins=16, range=(0, 1))[0]
    expected = len(values) / 16
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 37.7  # 15 degrees of freedom, p = 0.001
    assert abs(np.corrcoef(values, x)[0, 1]) < 4 / np.sqrt(len(x))
    # the same update masked in another round looks unrelated to the first masking
    _, _, _, again = masked_round(4, rnd=2, bits=32)
    other = field.from_wire(again[0].tensors[MASKED]).astype(np.float64) / 2**32
    assert abs(np.corrcoef(values, other)[0, 1]) < 4 / np.sqrt(len(x))


def test_stochastic_rounding_is_unbiased() -> None:
    """An update of constant value between two levels averages to that value over many clients."""
    plugin = make("secagg", clients=40, neighbours=4, clip_range=1.0, max_examples=2**16)
    fed = Federation(plugin)
    plugin.setup(1, list(range(40)), fed.exchange)
    step = 2 / plugin.levels
    value = -1 + 1000.3 * step  # 0.3 of a step above level 1000
    ups = [update({"w": torch.full((500,), value)}, num_examples=1, client_id=u) for u in range(40)]
    result = unmask(plugin, fed, [plugin.encode(u, fed.ctx(u.client_id)) for u in ups])["w"]
    # 20,000 Bernoulli(0.3) draws: the mean is within 4 standard errors of 0.3 of a step
    assert abs((result.double().mean().item() - value) / step) < 4 * math.sqrt(0.21 / 20000)


def rounded_sum(**params: Any) -> torch.Tensor:
    """The unmasked sum of two clients whose 2,000 entries each lie half a step between two
    levels: each entry's rounding is a fair coin, so the sum shows the rounding drawn."""
    plugin = make("secagg", clients=2, clip_range=1.0, **params)
    fed = Federation(plugin)
    plugin.setup(1, [0, 1], fed.exchange)
    value = -1 + 1000.5 * 2 / plugin.levels
    ups = [update({"w": torch.full((2000,), value)}, num_examples=1, client_id=u) for u in (0, 1)]
    return unmask(plugin, fed, [plugin.encode(u, fed.ctx(u.client_id)) for u in ups])["w"]


def test_stochastic_rounding_comes_from_the_secure_source_unless_a_simulation_seeds_it() -> None:
    """By default the rounding is fresh in every run, so the server cannot draw it again from
    the config; ``seeded_noise: true`` repeats it bit for bit, and is refused where the nodes
    run apart (as DP's seeded noise)."""
    assert not torch.equal(rounded_sum(), rounded_sum())  # 4,000 fair coins drawn twice alike: p = 2^-4000
    assert torch.equal(rounded_sum(seeded_noise=True), rounded_sum(seeded_noise=True))
    assert not torch.equal(rounded_sum(seeded_noise=True, seed=0), rounded_sum(seeded_noise=True, seed=1))
    seeded = "plugins.client_send=[{name: secagg, seeded_noise: true}]"
    assert small_config(seeded).plugins.client_send[0].params.seeded_noise
    with pytest.raises(ConfigError, match=r"^config key 'plugins.client_send\[0\].seeded_noise': plugin 'secagg'.*transport 'grpc'"):
        small_config(seeded, "transport=grpc", "launcher=process")


@pytest.mark.parametrize(("levels", "width"), [(2**16 - 1, 32), (2**28 - 1, 32), (2**40 - 1, 64)])
def test_quantization_skips_clipping_only_where_it_changes_nothing(levels: int, width: int) -> None:
    """Within the margin :meth:`Quantizer.inside` allows, the quantized values are those of
    the clipping pass, at both ends of the range and for every real type; outside, the
    clipping pass keeps every value within [0, L]."""
    quantize = Quantizer.of(1.0, levels, width)
    fine = 2.0 / (levels * (1 << quantize.fraction_bits))
    edge = np.array([-1 + 2.5 * fine, 1 - 2.5 * fine, 0.0, 0.5, -0.999, 0.999], dtype=quantize.real)  # half a fine step inside
    x = np.concatenate([edge, np.random.default_rng(0).uniform(-1, 1, 994).astype(quantize.real)])
    assert quantize.inside(float(x.min()), float(x.max()))
    assert not quantize.inside(-1.0, 0.5) and not quantize.inside(-0.5, 1.0)
    out_type = np.uint32 if width == 32 else np.uint64
    noise = np.random.default_rng(1).integers(0, 256, x.size, dtype=np.uint8)
    got = {}
    for inside in (False, True):
        out, spare = np.empty(x.size, out_type), np.empty(x.size, out_type)
        quantize(x, noise, x.copy(), spare, out, inside)
        got[inside] = out
    assert np.array_equal(got[False], got[True])
    out, spare = np.empty(3, out_type), np.empty(3, out_type)
    quantize(np.array([-5.0, 1.0, 7.0], quantize.real), np.full(3, 255, np.uint8), np.empty(3, quantize.real), spare, out)
    assert out.tolist() == [0, levels, levels]


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


def test_a_client_reveals_one_secret_per_owner_and_only_once() -> None:
    plugin, fed, _, masked = masked_round(6, threshold=0.6)
    request = Control("secagg", "unmask", {"survivors": torch.tensor([1, 2, 3, 4], dtype=torch.int32)})
    answer = plugin.answer(request, fed.ctx(0))  # client 5 dropped: a share of its record key
    assert answer.tensors["seed"].shape == (5, 8) and answer.tensors["key"].shape == (1, 8)
    with pytest.raises(ValueError, match="client 0 has no secure-aggregation set-up for round 1"):
        plugin.answer(request, fed.ctx(0))  # a second request could ask for the other secret
    too_few = Control("secagg", "unmask", {"survivors": torch.tensor([0], dtype=torch.int32)})
    with pytest.raises(ValueError, match="only 1 neighbours survived, fewer than the threshold 4"):
        plugin.answer(too_few, fed.ctx(1))
    two = Control("secagg", "unmask", {"survivors": torch.tensor([0, 3], dtype=torch.int32)})
    with pytest.raises(ValueError, match="only 2 neighbours survived, fewer than the threshold 4"):  # 2 + itself < t
        plugin.answer(two, fed.ctx(2))


def test_a_tampered_share_does_not_authenticate_and_its_receiver_leaves() -> None:
    plugin = make("secagg", clients=4)
    fed = Federation(plugin)

    def tamper(bodies: dict[int, Control]) -> dict[int, Control]:
        if bodies and next(iter(bodies.values())).step == "forward":
            bodies[2].tensors["shares"] = bodies[2].tensors["shares"].clone()
            bodies[2].tensors["shares"][0, 5] ^= 1
            with pytest.raises(ValueError, match="the share from client 0 does not authenticate"):
                plugin.answer(bodies[2], fed.ctx(2))
            return {u: plugin.answer(b, fed.ctx(u)) for u, b in bodies.items() if u != 2}
        return fed.exchange(bodies)

    assert plugin.setup(1, [0, 1, 2, 3], tamper) == [0, 1, 3]


def test_a_client_advertising_an_invalid_key_leaves_and_the_others_go_on(caplog: pytest.LogCaptureFixture) -> None:
    plugin = make("secagg", clients=4)
    fed = Federation(plugin)

    def low_order_key(bodies: dict[int, Control]) -> dict[int, Control]:
        answers = fed.exchange(bodies)
        if next(iter(bodies.values())).step == "advertise":
            answers[1] = Control("secagg", "advertise", {"key": torch.zeros(1, 32, dtype=torch.uint8)})
        return answers

    with caplog.at_level(logging.WARNING):
        assert plugin.setup(1, [0, 1, 2, 3], low_order_key) == [0, 2, 3]
    assert "client 1 leaves secure aggregation: its public key is not a valid X25519 point" in caplog.text


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (Control("secagg", "share", {}), "expected the cohort|expected cohort"),
        (Control("secagg", "share", {"cohort": torch.tensor([2, 1], dtype=torch.int32)}), "sorted list"),
        (Control("secagg", "share", {"cohort": torch.tensor([1, 2], dtype=torch.int32)}), "not in the cohort"),
        (
            Control("secagg", "share", {"cohort": torch.tensor([0, 1], dtype=torch.int32), "keys": torch.zeros(2, 32, dtype=torch.uint8)}),
            r"expected keys of torch.uint8 \(1, 32\)",
        ),
        (Control("secagg", "unmask", {}), "is at secagg step 'advertise' of round 1, not 'masked'"),
        (Control("secagg", "reboot", {}), "no step 'reboot'"),
    ],
)
def test_a_malformed_control_message_is_refused_with_a_reason(body: Control, error: str) -> None:
    plugin = make("secagg", clients=4)
    state: dict[str, Any] = {}
    plugin.answer(Control("secagg", "advertise"), PluginContext(1, 0, "client", state))
    with pytest.raises(ValueError, match=error):
        plugin.answer(body, PluginContext(1, 0, "client", state))


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


def test_a_round_whose_examples_could_wrap_the_field_aborts() -> None:
    plugin, fed, plain, masked = masked_round(3, max_examples=40)  # 10 + 17 + 24 = 51 examples together
    with pytest.raises(RoundError, match="more than max_examples=40"):
        plugin.combine(masked, ctx(1, -1, "server"), fed.exchange)


def test_every_step_crosses_the_wire_format_unchanged() -> None:
    """Control bodies (and the masked updates) survive :mod:`fedweave.transports.serialization`."""
    plugin = make("secagg", clients=4)
    fed = Federation(plugin)

    def wire(body: Any) -> Any:
        return ser.decode(ser.encode(Message(1, 0, body))).body

    def exchange(bodies: dict[int, Control]) -> dict[int, Control]:
        return {u: wire(a) for u, a in fed.exchange({u: wire(b) for u, b in bodies.items()}).items()}

    assert plugin.setup(1, [0, 1, 2, 3], exchange) == [0, 1, 2, 3]
    plain = [update(model_tensors(i, scale=0.5), num_examples=5 + i, client_id=i) for i in range(4)]
    masked = [wire(plugin.encode(u, fed.ctx(u.client_id))) for u in plain]
    server = ctx(1, -1, "server")
    result = plugin.decode(plugin.combine(masked, server, exchange), server).tensors
    assert_mean_within_quantization(result, plain, plugin)


def control_metadata(**changes: Any) -> bytes:
    """An encoded control message whose metadata fields are changed, with a correct checksum."""
    buf = ser.encode(Message(1, 0, Control("secagg", "share", {"cohort": torch.tensor([0, 1], dtype=torch.int32)})))
    _, _, _, meta_len, _, data_len = ser.HEADER.unpack_from(buf)
    meta = json.loads(bytes(buf[ser.HEADER.size : ser.HEADER.size + meta_len]))
    meta["fields"].update(changes)
    data = bytes(buf[len(buf) - data_len :])
    raw = json.dumps(meta).encode()
    head = ser.HEADER.pack(ser.MAGIC, ser.VERSION, 0, len(raw), zlib.crc32(raw), len(data)) + raw
    return head + bytes(-len(head) % ser.ALIGN) + data


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        ({"plugin": ""}, "control plugin '' is not a name"),
        ({"step": "a b"}, "control step 'a b' is not a name"),
        ({"step": 7}, "control step 7 is not a name"),
        ({"plugin": "x" * 101}, "is not a name"),
        ({"extra": 1}, r"control fields are not \['plugin', 'step'\]"),
    ],
)
def test_malformed_control_metadata_is_refused_by_the_wire_format(changes: dict[str, Any], error: str) -> None:
    assert ser.decode(control_metadata()).body.step == "share"  # the unchanged message decodes
    with pytest.raises(SerializationError, match=error):
        ser.decode(control_metadata(**changes))


# --------------------------------------------------------------------------- who holds which secret


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
        values += [s.astype("<u4").tobytes() for s in mine.shares.values()]
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
    assert not [v for v in values for b in blobs if v in b]


def test_the_server_half_holds_no_secret_of_any_client_at_any_step() -> None:
    plugin = make("secagg", clients=6, neighbours=2)
    fed = Federation(plugin)
    held: list[tuple[list[Any], list[bytes]]] = []

    def watched(bodies: dict[int, Control]) -> dict[int, Control]:
        answers = fed.exchange(bodies)
        held.append(secret_values(fed.states))
        assert_holds_none(plugin, *held[-1])
        return answers

    plugin.setup(1, list(range(6)), watched)
    plain = [update(model_tensors(i, scale=0.5), num_examples=10, client_id=i) for i in range(6)]
    masked = [plugin.encode(u, fed.ctx(u.client_id)) for u in plain]
    assert_holds_none(plugin, *secret_values(fed.states))
    assert_holds_none(plugin, *held[1])  # also the seeds and keys of the set-up, dropped since
    plugin.combine(masked, ctx(1, -1, "server"), watched)
    assert len(held) == 4 and all(values for _, values in held[:3])  # the clients did hold secrets
    assert held[3] == ([], [])  # and none after unmasking
    assert fed.states == {u: {} for u in range(6)}


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


# --------------------------------------------------------------------------- in a run


def control_bytes(n: int, k: int, model_entries: int) -> tuple[int, int]:
    """Hand count of one round's key and share traffic with n clients, each with k neighbours:
    (server to clients, clients to server) bytes of tensor data."""
    sent = n * (4 * n + 32 * k)  # share: the cohort (int32) and k public keys
    sent += n * (4 * k + SEALED_SHARES * k)  # forward: k senders (int32) and k sealed shares
    sent += n * 4 * k  # unmask: the k survivors
    received = n * 32  # advertise: a public key
    received += n * (16 * k + 16 + SEALED_SHARES * k)  # share: the seed record (16-byte seeds, GCM tag) and k sealed shares
    received += n * 32 * (k + 1)  # unmask: k + 1 shares of 16-byte self-mask seeds, 8 int32 limbs each
    return sent, received


def test_a_secagg_run_equals_plain_fedavg_within_quantization_and_counts_its_traffic(tmp_path: Path) -> None:
    plain, plain_records = run_to_end(tmp_path / "plain")
    secure, records = run_to_end(tmp_path / "secure", "plugins.client_send=[{name: secagg, bits: 48}]")
    assert_same_params(plain, secure, atol=1e-5)
    assert all(not r["skipped"] for r in records)
    sent, received = control_bytes(4, 3, 212)
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


def test_a_late_update_stays_hidden_by_its_self_mask_after_its_pair_masks_are_removed() -> None:
    """Bonawitz et al.'s reason for b_u: client 0's masked update arrives too late, so the
    round treats it as dropped and the survivors reveal its record key; the server opens its
    seed record and strips every pairwise mask from the late y_0. What is left must still be
    uniform, independent of n_0·x_0: only the self mask PRG(b_0), whose shares it never gets
    (each client reveals one secret per owner), hides it."""
    from fedweave.plugins.secure.secagg.keys import associated_data, open_sealed, sender_nonce
    from fedweave.plugins.secure.secagg.server import _chunks, _recover

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
        _recover(0, keys[0], setup.threshold[0], True), sender_nonce(0), setup.records[0], associated_data("seeds", 1, 0, 0), "record"
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


# --------------------------------------------------------------------------- what mutmut showed the tests missed


def test_the_server_combines_only_distinct_members_and_up_to_max_examples_inclusive() -> None:
    plugin, fed, plain, masked = masked_round(3, max_examples=51)  # exactly 10 + 17 + 24 examples: allowed
    for bad in ([masked[0], masked[0], masked[1]], [masked[0], dataclasses.replace(masked[1], client_id=7)]):
        with pytest.raises(RoundError, match=r"^secagg: round 1's updates do not come from distinct members of its cohort$"):
            plugin.combine(bad, ctx(1, -1, "server"), fed.exchange)
    combined = plugin.combine(masked, ctx(1, -1, "server"), fed.exchange)
    assert combined.kind is plain[0].kind and combined.num_examples == 51
    assert_mean_within_quantization(plugin.decode(combined, ctx(1, -1, "server")).tensors, plain, plugin)
    with pytest.raises(ValueError, match=r"^secagg decodes only the server's combined sum, never one client's masked update$"):
        plugin.decode(masked[0], ctx(1, -1, "server"))


def test_four_of_ten_drop_after_masking_each_survivor_holds_exactly_the_threshold() -> None:
    """n = 10, t = 6: each of the 6 survivors and its 5 surviving neighbours make exactly 6 holders."""
    plugin, fed, plain, masked = masked_round(10, threshold=0.6)
    survivors = [m for m in masked if m.client_id not in (1, 4, 6, 8)]
    result = unmask(plugin, fed, survivors)
    assert_mean_within_quantization(result, [u for u in plain if u.client_id not in (1, 4, 6, 8)], plugin)


def test_a_dropped_clients_record_key_short_of_holders_is_named() -> None:
    from fedweave.plugins.secure.secagg.server import _enough, _recover

    with pytest.raises(RoundError, match=r"^secagg: only 2 of client 4's share holders survived, its record key needs 3 \(threshold\); the sum cannot be unmasked$"):
        _enough(4, 2, 3, True, "survived")
    with pytest.raises(RoundError, match=r"^secagg: only 1 of client 2's share holders answered, its self-mask seed needs 3"):
        _recover(2, [(1, np.zeros(8, np.int32))], 3, False)
    with pytest.raises(RoundError, match=r"^secagg: only 0 of client 5's share holders answered, its record key needs 1"):
        _recover(5, None, 1, True)


def test_a_malformed_unmasking_answer_is_logged_and_the_others_still_unmask(caplog: pytest.LogCaptureFixture) -> None:
    plugin, fed, plain, masked = masked_round(6, threshold=0.5)

    def garbled(bodies: dict[int, Control]) -> dict[int, Control]:
        answers = fed.exchange(bodies)
        if next(iter(bodies.values())).step == "unmask":
            answers[0] = Control("secagg", "unmask", {"seed": torch.zeros(1, dtype=torch.int32)})
        return answers

    server = ctx(1, -1, "server")
    with caplog.at_level(logging.WARNING):
        result = plugin.decode(plugin.combine(masked, server, garbled), server).tensors
    assert_mean_within_quantization(result, plain, plugin)  # the lowest id was refused: the next answers are read
    assert [r.getMessage() for r in caplog.records] == [
        "round 1: client 0's unmasking answer refused: secagg unmask: expected seed of torch.int32 (6, 8), got torch.int32 (1,)"
    ]


def test_inconsistent_or_forged_shares_skip_the_round_naming_the_client() -> None:
    plugin, fed, _, masked = masked_round(4, lost={"train": {3}})

    def forged(bodies: dict[int, Control]) -> dict[int, Control]:
        answers = fed.exchange(bodies)
        if next(iter(bodies.values())).step == "unmask":
            for u, a in answers.items():
                key = a.tensors["key"].clone()
                key[:, 0] = (key[:, 0] + 12345) % 65536  # a wrong share of client 3's record key
                answers[u] = Control("secagg", "unmask", {"seed": a.tensors["seed"], "key": key})
        return answers

    with pytest.raises(RoundError, match=r"^secagg: (client 3's shares are inconsistent \(.+\)|.*client 3's seed record.* with its rebuilt key)$"):
        plugin.combine(masked, ctx(1, -1, "server"), forged)


def test_a_client_answers_only_about_its_neighbours() -> None:
    plugin, fed, _, masked = masked_round(8, neighbours=4)
    u = masked[0].client_id
    strangers = [v for v in range(8) if v != u and v not in plugin.round.neighbours[u]]
    request = Control("secagg", "unmask", {"survivors": torch.tensor(strangers[:3], dtype=torch.int32)})
    with pytest.raises(ValueError, match="survivors is not a sorted list of distinct expected client ids"):
        plugin.answer(request, fed.ctx(u))


@pytest.mark.parametrize(("clip", "levels", "width"), [(2.0, 2**16 - 1, 32), (0.5, 2**28 - 1, 32)])
def test_quantization_by_hand(clip: float, levels: int, width: int) -> None:
    """q = ⌊(⌊t·2^f + ½⌋ + (noise >> (8 − f))) / 2^f⌋ with t = (clip(x) + R)·L / 2R, in exact arithmetic,
    for 8 fraction bits (float32) and for 4 (L = 2^28 − 1 leaves 4 bits of a 32-bit field)."""
    from fractions import Fraction

    quantize = Quantizer.of(clip, levels, width)
    f = quantize.fraction_bits
    assert f == (8 if levels < 2**20 else 4)
    rng = np.random.default_rng(5)
    x = np.concatenate([rng.uniform(-clip, clip, 300), [-clip, clip, -3 * clip, 3 * clip, 0.0]]).astype(quantize.real)
    noise = np.concatenate([rng.integers(0, 256, 300), [0, 0, 255, 0, 255]]).astype(np.uint8)
    out, spare = np.empty(x.size, np.uint32), np.empty(x.size, np.uint32)
    quantize(x, noise, np.empty(x.size, quantize.real), spare, out)
    for xi, ni, qi in zip(x.tolist(), noise.tolist(), out.tolist()):
        t = (Fraction(min(max(xi, -clip), clip)) + Fraction(clip)) * levels / (2 * Fraction(clip))
        fine = int(t * 2**f + Fraction(1, 2))  # to the nearest multiple of 2^-f
        assert abs(qi - (fine + (ni >> (8 - f))) // 2**f) <= (1 if quantize.real is np.float32 else 0), (xi, ni)
    assert out[-5] == 0 and out[-4] == levels and out[-3] == 0 and out[-2] == levels  # the ends, clipped or not
    fine_step = 2 * clip / (levels * (1 << f))
    margin = 2 * fine_step
    assert quantize.inside(-clip + margin, clip - margin)  # the margin itself is inside
    assert not quantize.inside(-clip + 1.5 * fine_step, 0.0) and not quantize.inside(0.0, clip - 1.5 * fine_step)


def test_a_client_warns_when_more_than_one_percent_of_its_update_is_clipped(caplog: pytest.LogCaptureFixture) -> None:
    plugin = make("secagg", clients=3, clip_range=1.0)
    fed = Federation(plugin)
    plugin.setup(1, [0, 1, 2], fed.exchange)

    def send(u: int, values: list[float]) -> None:
        w = torch.zeros(200)
        w[: len(values)] = torch.tensor(values)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            plugin.encode(update({"w": w}, client_id=u), fed.ctx(u))

    send(0, [-1.5, -2.0, -7.0])  # 3 of 200 below −R: 1.5 %
    assert [r.getMessage() for r in caplog.records] == ["secagg: client 0 clipped 3 of 200 entries to ±1 (raise clip_range)"]
    send(1, [1.5, -2.0, 1.0, -1.0, 1.0])  # 2 beyond ±R (the entries at ±R are not clipped): 1 %, no warning
    assert caplog.text == ""
    with pytest.raises(ValueError, match=r"^client 2 holds 65537 examples, more than secagg's max_examples=65536$"):
        plugin.encode(update({"w": torch.zeros(200)}, num_examples=65537, client_id=2), fed.ctx(2))
    plugin.encode(update({"w": torch.zeros(200)}, num_examples=65536, client_id=2), fed.ctx(2))  # at the bound: sent


@pytest.mark.parametrize(("bits", "dtype", "max_examples"), [(24, torch.int32, 256), (32, torch.int32, 2**16), (33, torch.int64, 256), (40, torch.int64, 2**16)])
def test_other_field_sizes_sum_exactly_and_travel_as_their_width(bits: int, dtype: torch.dtype, max_examples: int) -> None:
    plugin, fed, plain, masked = masked_round(4, bits=bits, max_examples=max_examples)
    for m in masked:
        assert m.tensors[MASKED].dtype == dtype and m.tensors[MASKED].numel() == 32 * 20 + 32 + 4 * 32 + 4
        values = plugin.field.from_wire(m.tensors[MASKED])
        assert int(values.max()) < 2**bits  # reduced into the field
    assert_mean_within_quantization(unmask(plugin, fed, masked), plain, plugin)


def test_an_update_without_floating_tensors_is_masked_and_summed() -> None:
    plugin = make("secagg", clients=3)
    fed = Federation(plugin)
    plugin.setup(1, [0, 1, 2], fed.exchange)
    counters = [update({"n": torch.tensor(3 + u)}, client_id=u) for u in range(3)]
    masked = [plugin.encode(u, fed.ctx(u.client_id)) for u in counters]
    server = ctx(1, -1, "server")
    assert plugin.decode(plugin.combine(masked, server, fed.exchange), server).tensors["n"].item() == 5


def test_a_round_needs_two_clients_to_advertise_and_two_is_enough(caplog: pytest.LogCaptureFixture) -> None:
    plugin, fed, plain, masked = masked_round(2)  # the smallest secure aggregation
    assert_mean_within_quantization(unmask(plugin, fed, masked), plain, plugin)
    lonely = make("secagg", clients=3)
    with pytest.raises(RoundError, match=r"^secagg: 1 client\(s\) advertised keys; secure aggregation needs 2$"):
        lonely.setup(1, [0, 1, 2], Federation(lonely, lost={"advertise": {1, 2}}).exchange)
    bad = make("secagg", clients=3)
    clients = Federation(bad)

    def malformed_share(bodies: dict[int, Control]) -> dict[int, Control]:
        answers = clients.exchange(bodies)
        if next(iter(bodies.values())).step == "share":
            answers[2] = Control("secagg", "share", {})
        return answers

    with caplog.at_level(logging.WARNING):
        assert bad.setup(4, [0, 1, 2], malformed_share) == [0, 1]
    assert [r.getMessage() for r in caplog.records] == [
        "round 4: client 2 leaves secure aggregation: secagg share: expected shares of torch.uint8 (2, 80), got nothing"
    ]


def test_malformed_set_up_messages_are_refused_with_what_was_expected() -> None:
    plugin = make("secagg", clients=4)
    state: dict[str, Any] = {}
    plugin.answer(Control("secagg", "advertise"), PluginContext(1, 0, "client", state))
    cohort = torch.tensor([0, 1], dtype=torch.int32)
    cases = [
        ({"cohort": cohort, "keys": torch.zeros(1, 32, dtype=torch.int32)}, r"expected keys of torch.uint8 \(1, 32\), got torch.int32 \(1, 32\)"),
        ({"cohort": cohort}, r"expected keys of torch.uint8 \(1, 32\), got nothing$"),
        ({"cohort": torch.tensor([0, 1], dtype=torch.int64)}, r"^secagg share: expected cohort as a 1-d int32 tensor$"),
    ]
    for tensors, error in cases:
        with pytest.raises(ValueError, match=error):
            plugin.answer(Control("secagg", "share", tensors), PluginContext(1, 0, "client", state))
    other = make("secagg", clients=4)
    twins: dict[str, Any] = {}
    key = other.answer(Control("secagg", "advertise"), PluginContext(1, 1, "client", twins)).tensors["key"]
    three = torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^secagg share: the neighbours' public keys are not distinct$"):
        plugin.answer(Control("secagg", "share", {"cohort": three, "keys": torch.cat([key, key])}), PluginContext(1, 0, "client", state))


def test_a_client_takes_shares_only_from_its_neighbours_and_only_enough_of_them(caplog: pytest.LogCaptureFixture) -> None:
    """Forwarding: senders must be neighbours of the receiver, and at least t − 1 of them."""
    plugin = make("secagg", clients=8, neighbours=4)  # t = 3 of 5
    fed = Federation(plugin)
    seen: dict[int, Control] = {}

    def keep(bodies: dict[int, Control]) -> dict[int, Control]:
        if next(iter(bodies.values())).step == "forward":
            seen.update(bodies)
            return {}
        return fed.exchange(bodies)

    with pytest.raises(RoundError, match=r"^secagg: 0 client\(s\) completed the key set-up; secure aggregation needs 2$"):
        plugin.setup(1, list(range(8)), keep)
    graph = plugin.round.neighbours
    body = seen[0]
    senders = body.tensors["senders"].tolist()
    stranger = next(v for v in range(1, 8) if v not in graph[0])
    wrong = dict(body.tensors, senders=torch.tensor(sorted([*senders[1:], stranger]), dtype=torch.int32))
    with pytest.raises(ValueError, match="senders is not a sorted list of distinct expected client ids"):
        plugin.answer(Control("secagg", "forward", wrong), fed.ctx(0))
    two = dict(body.tensors, senders=body.tensors["senders"][:2], shares=body.tensors["shares"][:2])
    assert plugin.answer(Control("secagg", "forward", two), fed.ctx(0)).step == "forward"  # 2 + itself = t: enough
    one = dict(seen[1].tensors, senders=seen[1].tensors["senders"][:1], shares=seen[1].tensors["shares"][:1])
    with pytest.raises(ValueError, match=r"^secagg forward: only 1 neighbours completed the set-up, fewer than the threshold 3 of this client's neighbourhood$"):
        plugin.answer(Control("secagg", "forward", one), fed.ctx(1))


def test_fraction_bits_follow_the_real_type_and_the_field() -> None:
    """f = min(8, mantissa − used bits, width − used bits), at least 0: the rounding never overflows."""
    assert Quantizer.of(1.0, 2**16 - 1, 32).real is np.float32 and Quantizer.of(1.0, 2**17 - 1, 32).real is np.float64
    assert Quantizer.of(1.0, 2**32 - 1, 32).fraction_bits == 0  # max_examples 1: no room left in the field
    assert Quantizer.of(1.0, 2**48 - 1, 64).fraction_bits == 5  # float64's 53 bits bind before the field's 64


@pytest.mark.parametrize("bits", [32, 24])
def test_a_full_round_at_the_range_ends_does_not_wrap_the_field(bits: int) -> None:
    """max_examples examples, every entry at ±R (level L or 0): Σ n·L = max_examples·L < 2^bits, exactly."""
    plugin = make("secagg", clients=2, max_examples=64, bits=bits)
    fed = Federation(plugin)
    plugin.setup(1, [0, 1], fed.exchange)
    ends = [update({"w": torch.tensor([4.0, -4.0, 9.0])}, num_examples=32, client_id=u) for u in range(2)]
    result = unmask(plugin, fed, [plugin.encode(u, fed.ctx(u.client_id)) for u in ends])["w"]
    assert result.tolist() == [4.0, -4.0, 4.0]
