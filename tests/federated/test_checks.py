"""Tests of fedweave.federated.checks: an update's tensors, extras, claims and senders against the run's schema."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import MappingProxyType

import pytest
import torch
from torch import nn

from fedweave.strategies.fedbn import FedBN, FedBNHParams
from fedweave.strategies.fednova import NORM, FedNova, FedNovaHParams
from fedweave.strategies.fedper import FedPer, FedPerHParams
from fedweave.strategies.scaffold import Scaffold, ScaffoldHParams
from fedweave.types import Evaluation, Update, UpdateKind
from fedweave.federated.checks import (
    check_ciphertexts,
    ExampleLimits,
    Rejected,
    TensorSpec,
    UpdateSchema,
    WeightPolicy,
    bounded_examples,
    cap_weight_share,
    capped_weights,
    check_senders,
    check_update,
    claim_ceilings,
    finite,
    lower_median,
    valid_evaluation,
)

from conftest import assert_same_params, run_to_end

MODEL = {"w": torch.zeros(2, 3), "b": torch.zeros(3), "n": torch.tensor(0)}
SCHEMA = UpdateSchema.of(MODEL)


def update(tensors: dict[str, torch.Tensor] | None = None, **fields: object) -> Update:
    base = {"w": torch.ones(2, 3), "b": torch.ones(3), "n": torch.tensor(4)}
    return Update(UpdateKind.DELTA, base if tensors is None else tensors, 10, **fields)  # type: ignore[arg-type]


def reason(u: Update, schema: UpdateSchema = SCHEMA, encoded: bool = False) -> tuple[str, str]:
    with pytest.raises(Rejected) as info:
        check_update(u, schema, encoded)
    return info.value.reason, str(info.value)


def test_an_update_of_the_model_schema_passes() -> None:
    check_update(update(), SCHEMA)


@pytest.mark.parametrize(
    ("tensors", "expected"),
    [
        ({}, ("names", "lacks tensors ['b', 'n', 'w']")),
        ({"w": torch.ones(2, 3), "n": torch.tensor(1)}, ("names", "lacks tensors ['b']")),
        (
            {"w": torch.ones(2, 3), "b": torch.ones(3), "n": torch.tensor(1), "x": torch.ones(1)},
            ("names", "holds undeclared tensors ['x']"),
        ),
        (
            {"w": torch.ones(2, 3, dtype=torch.float64), "b": torch.ones(3), "n": torch.tensor(1)},
            ("dtype", "tensor 'w' is torch.float64, expected torch.float32"),
        ),
        (
            {"w": torch.ones(2, 3, dtype=torch.int8), "b": torch.ones(3), "n": torch.tensor(1)},
            ("dtype", "tensor 'w' is torch.int8, expected torch.float32"),
        ),
        (
            {"w": torch.ones(2, 3), "b": torch.ones(3, dtype=torch.bool), "n": torch.tensor(1)},
            ("dtype", "tensor 'b' is torch.bool, expected torch.float32"),
        ),
        (
            {"w": torch.ones(3, 2), "b": torch.ones(3), "n": torch.tensor(1)},
            ("shape", "tensor 'w' has shape (3, 2), expected (2, 3)"),
        ),
        (
            {"w": torch.ones(2, 3), "b": torch.tensor([0.0, float("nan"), 1.0]), "n": torch.tensor(1)},
            ("non_finite", "tensor 'b' holds NaN or infinite values"),
        ),
        (
            {"w": torch.ones(2, 3).to_sparse(), "b": torch.ones(3), "n": torch.tensor(1)},
            ("malformed", "tensor 'w' is not a dense tensor"),
        ),
        (
            {"w": [[1.0] * 3] * 2, "b": torch.ones(3), "n": torch.tensor(1)},
            ("malformed", "tensor 'w' is not a dense tensor"),
        ),
    ],
    ids=["none", "missing", "extra", "float64", "int8", "bool", "shape", "nan", "sparse", "list"],
)
def test_tensors_must_match_the_model(tensors: dict[str, torch.Tensor], expected: tuple[str, str]) -> None:
    assert reason(update(tensors)) == expected


@pytest.mark.parametrize("claim", [0, -3, 2.5, True, 2**53 + 1, 10**400])
def test_an_update_claims_a_whole_positive_number_of_examples(claim: object) -> None:
    bad = dataclasses.replace(update(), num_examples=claim)
    assert reason(bad) == ("examples", f"it claims {claim!r} examples, not a whole number in 1..2^53")


def test_extras_must_be_those_the_strategy_declares() -> None:
    schema = UpdateSchema(SCHEMA.tensors, {"w": TensorSpec((2, 3), torch.float32)})
    check_update(update(extras={"w": torch.ones(2, 3)}), schema)
    assert reason(update(extras={}), schema) == ("extras", "lacks extras tensors ['w']")
    assert reason(update(extras={"w": torch.ones(2, 3)})) == ("extras", "holds undeclared extras tensors ['w']")
    # a 1 GiB extras tensor (stride 0: no memory behind it) for a three-entry model
    huge = torch.zeros(1).expand(2**28)
    assert reason(update(extras={"w": huge}), schema) == ("extras", "extras tensor 'w' has shape (268435456,), "
                                                                    "expected (2, 3)")
    assert reason(update(extras={"huge": huge})) == ("extras", "holds undeclared extras tensors ['huge']")
    nan = update(extras={"w": torch.full((2, 3), float("inf"))})
    assert reason(nan, schema) == ("non_finite", "extras tensor 'w' holds NaN or infinite values")


def test_an_encoded_update_is_checked_for_its_claims_and_extras_only() -> None:
    encoded = update({"secagg.masked": torch.ones(7, dtype=torch.int64)}, applied=["secagg"])
    check_update(encoded, SCHEMA, encoded=True)
    assert reason(dataclasses.replace(encoded, num_examples=0), encoded=True)[0] == "examples"
    assert reason(dataclasses.replace(encoded, extras={"c": torch.ones(1)}), encoded=True)[0] == "extras"


def test_the_update_kind_is_the_strategys() -> None:
    schema = dataclasses.replace(SCHEMA, kind=UpdateKind.DELTA)
    check_update(update(), schema)
    weights = dataclasses.replace(update(), kind=UpdateKind.WEIGHTS)
    assert reason(weights, schema) == ("malformed", "it is a 'weights' update, the strategy's clients send 'delta'")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(2, 3)
        self.norm = nn.BatchNorm1d(3)
        self.head = nn.Linear(3, 2)


def test_strategies_declare_what_their_updates_hold() -> None:
    net = Net()
    entries = dict(net.state_dict())
    scaffold = Scaffold.update_schema(net, ScaffoldHParams())
    assert set(scaffold.tensors) == set(entries)
    assert scaffold.extras == {n: TensorSpec(tuple(p.shape), p.dtype) for n, p in net.named_parameters()}
    assert "norm.running_mean" not in scaffold.extras  # a buffer has no control variate
    nova = FedNova.update_schema(net, FedNovaHParams())
    assert set(nova.tensors) == set(entries) and nova.extras == {NORM: TensorSpec((), torch.float64)}
    per = FedPer.update_schema(net, FedPerHParams(personal=["head.*"]))
    assert set(per.tensors) == set(entries) - {"head.weight", "head.bias"} and not per.extras
    bn = FedBN.update_schema(net, FedBNHParams())
    assert set(bn.tensors) == {"body.weight", "body.bias", "head.weight", "head.bias"}


def senders(u: Update, sender: int, may: set[int], counted: set[int] | None = None) -> list[int]:
    return check_senders(u, sender, may, counted or set())


def test_a_plain_client_speaks_for_itself_only() -> None:
    assert senders(update(), 3, {3}) == [3]
    crafted = update(clients=5, members=[0, 1, 2, 3, 3])
    with pytest.raises(Rejected, match=r"names clients \[0, 1, 2, 3, 3\] more than once"):
        senders(crafted, 0, {0})
    with pytest.raises(Rejected, match=r"clients \[1, 2, 3\], for whom its sender may not speak"):
        senders(update(clients=4, members=[0, 1, 2, 3]), 0, {0})
    with pytest.raises(Rejected, match="claims to stand for 5 clients but names 1"):
        senders(update(clients=5), 0, {0})


def test_a_site_update_stands_for_members_of_its_site_each_once_per_round() -> None:
    site = update(clients=3, members=[4, 5, 7])
    assert senders(site, 4, {4, 5, 6, 7}) == [4, 5, 7]
    with pytest.raises(Rejected, match=r"clients \[7\], for whom"):
        senders(site, 4, {4, 5, 6})
    with pytest.raises(Rejected, match=r"clients \[5\] were counted already this round"):
        senders(site, 4, {4, 5, 6, 7}, {5})
    with pytest.raises(Rejected, match="claims to stand for 2 clients but names 3"):
        senders(dataclasses.replace(site, clients=2), 4, {4, 5, 7})
    with pytest.raises(Rejected, match="do not include its sender"):
        senders(site, 6, {4, 5, 6, 7})


def test_a_claim_above_the_limit_is_lowered_or_refused_when_encoded() -> None:
    limits = ExampleLimits(max_examples=500, size_of=lambda cid: {0: 120, 1: 80}.get(cid, 0))
    assert limits.limit([0]) == 120 and limits.limit([0, 1]) == 200 and limits.limit([9]) == 0
    assert ExampleLimits(max_examples=500).limit([0]) == 500 and ExampleLimits().limit([0]) is None
    inflated = dataclasses.replace(update(), num_examples=1_000_000)
    assert bounded_examples(inflated, limits.limit([0])).num_examples == 120
    honest = update()
    assert bounded_examples(honest, 120) is honest  # a claim within the limit is kept
    with pytest.raises(Rejected, match="claims 1000000 examples, more than the 120 it may") as info:
        bounded_examples(inflated, 120, encoded=True)
    assert info.value.reason == "examples"


@pytest.mark.parametrize(
    ("weights", "share", "expected"),
    [
        # c = 0.5 · (100 + 100 + 100) / (1 − 0.5): 300 of 600
        ([1e6, 100, 100, 100], 0.5, [300, 100, 100, 100]),
        # c = 0.35 · (3 + 2 + 1) / (1 − 0.35) = 2.1 / 0.65: the 3 stays below it
        ([4, 3, 2, 1], 0.35, [2.1 / 0.65, 3, 2, 1]),
        # two capped: c = 0.3 · (2 + 1) / (1 − 0.6) = 2.25
        ([9, 5, 2, 1], 0.3, [2.25, 2.25, 2, 1]),
        ([1, 2, 3, 4], 0.4, [1, 2, 3, 4]),  # 4 of 10 is the share itself
        ([5, 1], 0.4, [1, 1]),  # two weights cannot be below 0.5 each: equal
    ],
)
def test_capped_weights(weights: list[float], share: float, expected: list[float]) -> None:
    out = capped_weights(weights, share)
    assert out == pytest.approx(expected, rel=1e-12)
    if len(weights) * share >= 1:
        assert max(out) / sum(out) <= share + 1e-12


def test_cap_weight_share_lowers_claims_to_whole_examples() -> None:
    updates = [dataclasses.replace(update(), num_examples=n) for n in (1_000_000, 100, 100, 101)]
    assert [u.num_examples for u in cap_weight_share(updates, 0.5)] == [301, 100, 100, 101]
    assert all(a is b for a, b in zip(cap_weight_share(updates, None), updates))


def test_lower_median() -> None:
    assert lower_median([5]) == 5 and lower_median([3, 1, 2]) == 2
    assert lower_median([1e6, 100, 120, 80]) == 100  # the smaller of 100 and 120: 1e6 cannot move it
    with pytest.raises(ValueError):
        lower_median([])


@pytest.mark.parametrize(
    ("claims", "ratio", "reference", "expected"),
    [
        # per client 100, 110, 120, 10^6: lower median 110; 4 x 110 = 440
        ([(100, 1), (110, 1), (120, 1), (1_000_000, 1)], 4.0, [], [440, 440, 440, 440]),
        # a site of 3 claiming 300 enters 100 three times: 50, 100, 100, 100, 900 -> median 100
        ([(50, 1), (300, 3), (900, 1)], 2.0, [], [200, 600, 200]),
        # FedBuff: one buffered claim of 10^6, the others' latest 100, 110, 90 -> median 100
        ([(1_000_000, 1)], 3.0, [100, 110, 90], [300]),
        # 2.5 x 3 x 1 = 7.5 rounds down; a bound is never below 1
        ([(3, 1), (3, 1)], 2.5, [], [7, 7]),
        ([(1, 4)], 1.0, [], [1]),
    ],
)
def test_claim_ceilings(
    claims: list[tuple[int, int]], ratio: float, reference: list[float], expected: list[int]
) -> None:
    assert claim_ceilings(claims, ratio, reference) == expected


def test_the_weight_policy_caps_refuses_or_trusts_a_claim_above_its_cohort() -> None:
    """Claims 100, 110, 120 and 10^6 of senders 0..3: the bound is 3 x 110 = 330 (the default ratio)."""
    updates = [dataclasses.replace(update(), num_examples=n, client_id=i) for i, n in enumerate((100, 110, 120, 10**6))]
    capped = WeightPolicy("cap").bound(updates)
    assert [u.num_examples for u in capped.kept] == [100, 110, 120, 330] and capped.capped == [3]
    assert capped.kept[:3] == updates[:3] and not capped.refused
    refused = WeightPolicy("refuse").bound(updates)
    assert refused.kept == updates[:3] and list(refused.refused) == [3] and not refused.capped
    assert "claims 1000000 examples, more than the 330 its cohort allows" in refused.refused[3]
    trusted = WeightPolicy("trust").bound(updates)
    assert trusted.kept == updates and not trusted.capped and not trusted.refused
    encoded = [dataclasses.replace(u, applied=["secagg"]) for u in updates]  # its weight is inside the encoding
    assert list(WeightPolicy("cap").bound(encoded).refused) == [3]


def test_a_claim_above_the_count_declared_at_registration_is_capped_or_refused() -> None:
    """Client 3 declared 150 examples at registration: its claim of 300, within its cohort's bound
    (3 x 110 = 330), counts 150; declaring 10^6 gains nothing beyond the cohort's 330."""
    updates = [dataclasses.replace(update(), num_examples=n, client_id=i) for i, n in enumerate((100, 110, 120, 300))]
    capped = WeightPolicy("cap").bound(updates, declared={3: 150, 0: 100})
    assert [u.num_examples for u in capped.kept] == [100, 110, 120, 150] and capped.capped == [3]
    refused = WeightPolicy("refuse").bound(updates, declared={3: 150})
    assert refused.kept == updates[:3] and list(refused.refused) == [3]
    assert "claims 300 examples, more than the 150 it declared at registration" in refused.refused[3]
    inflated = [*updates[:3], dataclasses.replace(updates[3], num_examples=10**6)]
    declared_high = WeightPolicy("cap").bound(inflated, declared={3: 10**6})
    assert [u.num_examples for u in declared_high.kept] == [100, 110, 120, 330]
    assert WeightPolicy("trust").bound(updates, declared={3: 150}).kept == updates


def test_non_finite_values_of_any_float_dtype_are_found() -> None:
    schema = UpdateSchema.of({"w": torch.zeros(1, dtype=torch.float16), "n": torch.tensor(0)})
    check_update(update({"w": torch.ones(1, dtype=torch.float16), "n": torch.tensor(2)}), schema)
    bad = update({"w": torch.tensor([float("-inf")], dtype=torch.float16), "n": torch.tensor(2)})
    assert reason(bad, schema)[0] == "non_finite"


def test_a_run_goes_on_past_bad_updates_and_inflated_claims(tmp_path: Path) -> None:
    """Client 2's noise overflows float32 each round: rejected, counted, the run finishes. A
    client claiming 10^6 examples in simulation counts as its partition size: the run is the clean one."""
    params, records = run_to_end(tmp_path / "inf", "attacks.kind=noise", "attacks.clients=[2]", "attacks.std=1e39")
    assert [r["rejected"] for r in records] == [{"non_finite": 1}] * len(records)
    assert all(bool(torch.isfinite(v).all()) for v in params.values() if v.is_floating_point())
    clean, _ = run_to_end(tmp_path / "clean")
    inflated, _ = run_to_end(tmp_path / "inflated", "attacks.kind=inflate_examples", "attacks.clients=[1]")
    assert_same_params(inflated, clean)


def test_any_mapping_serves_as_tensors_and_metrics_and_a_list_does_not() -> None:
    """A plain dict is the fast case; any other Mapping is read the same, a sequence is malformed."""
    base = update()
    check_update(update(MappingProxyType(dict(base.tensors)), metrics=MappingProxyType({"train_loss": 0.5})), SCHEMA)
    assert reason(update(list(base.tensors.values())))[0] == "malformed"  # type: ignore[arg-type]
    assert reason(update(metrics=[("train_loss", 0.5)]))[0] == "malformed"


def test_metrics_must_be_numbers() -> None:
    check_update(update(metrics={"train_loss": float("nan"), "steps": 3}), SCHEMA)  # a diverged loss is reported
    assert reason(update(metrics={"train_loss": "low"}))[0] == "malformed"
    assert reason(update(metrics={"train_loss": True}))[0] == "malformed"
    assert valid_evaluation(Evaluation(5, {"accuracy": 0.5}))
    assert not valid_evaluation(Evaluation(5, {"accuracy": float("nan")}))
    assert not valid_evaluation(Evaluation(5, {"accuracy": [0.5]}))  # type: ignore[dict-item]
    assert not valid_evaluation(Evaluation(0, {"accuracy": 0.5}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", [0, 777, 99_999])
def test_finite_finds_one_bad_entry_anywhere(dtype: torch.dtype, bad: float, where: int) -> None:
    w = torch.randn(100_000, generator=torch.Generator().manual_seed(0)).to(dtype)
    assert finite(w) and finite(torch.empty(0, dtype=dtype))
    w[where] = bad
    assert not finite(w.reshape(100, 1000))


def test_ciphertexts_are_exactly_the_expected_names_of_bounded_uint8_bytes() -> None:
    names = ["__he_00000", "__he_00001"]
    good = {n: torch.zeros(10, dtype=torch.uint8) for n in names}
    check_ciphertexts(good, names, max_bytes=10)
    bad = [
        ({names[0]: good[names[0]]}, "lacks \\['__he_00001'\\]"),
        ({**good, "__he_00002": good[names[0]]}, "holds ciphertexts \\['__he_00002'\\]"),
        ({**good, names[1]: torch.zeros(10)}, "'__he_00001' is not a 1-D uint8 tensor"),
        ({**good, names[1]: torch.zeros(2, 5, dtype=torch.uint8)}, "not a 1-D uint8 tensor"),
        ({**good, names[1]: [0] * 10}, "not a 1-D uint8 tensor"),
        ({**good, names[1]: torch.zeros(11, dtype=torch.uint8)}, "has 11 bytes, not 1..10"),
        ({**good, names[1]: torch.zeros(0, dtype=torch.uint8)}, "has 0 bytes"),
    ]
    for ciphertexts, reason in bad:
        with pytest.raises(Rejected, match=reason) as err:
            check_ciphertexts(ciphertexts, names, max_bytes=10)
        assert err.value.reason == "malformed"


@pytest.mark.parametrize("dtype, big", [(torch.float32, 3e38), (torch.float16, 6e4), (torch.bfloat16, 3e38)])
def test_finite_entries_whose_sum_overflows_are_finite(dtype: torch.dtype, big: float) -> None:
    w = torch.full((4,), big, dtype=dtype)
    assert not torch.isfinite(w.sum()) and finite(w)
    w[2] = -float("inf")
    assert not finite(w)
