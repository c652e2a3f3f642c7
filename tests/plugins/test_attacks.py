"""Tests of fedweave.plugins.attacks.poison: each attack does what it says, on the chosen clients
only, through the client runtime; robust rules resist two sign-flipping, scaling attackers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedweave import config as config_mod
from fedweave.build import build_chains, build_client_runtime, build_task
from fedweave.federated.client import ClientStateStore
from fedweave.plugins.attacks.poison import Attacker, flipped_labels, noisy, scaled
from fedweave.strategies.aggregate import weighted_average
from fedweave.strategies.robust import coordinate_median, multi_krum, trimmed_mean
from fedweave.types import Instruction, Message, TaskKind, Update, UpdateKind, Work

START = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(3)}


def delta(values: list[float], kind: UpdateKind = UpdateKind.DELTA) -> Update:
    return Update(kind, {"w": torch.tensor(values), "n": torch.tensor(5)}, num_examples=7, extras={"c": torch.ones(1)})


def test_the_pure_transforms() -> None:
    d = {"w": torch.tensor([0.5, -1.0]), "n": torch.tensor(5)}
    flipped = scaled(d, -10.0)
    assert torch.equal(flipped["w"], torch.tensor([-5.0, 10.0])) and flipped["n"] is d["n"]
    gen = torch.Generator().manual_seed(7)
    expected = torch.randn(2, generator=torch.Generator().manual_seed(7), dtype=torch.float64) * 0.5
    torch.testing.assert_close(noisy(d, 0.5, gen)["w"], (d["w"].double() + expected).float(), rtol=0, atol=0)
    assert flipped_labels(torch.tensor([0, 3, 9]), 10).tolist() == [9, 6, 0]


@pytest.mark.parametrize(
    ("kinds", "expected"),
    [
        (["sign_flip"], [-5.0, 10.0]),  # −10 · (0.5, −1)
        (["scaling"], [5.0, -10.0]),
        (["sign_flip", "scaling"], [-50.0, 100.0]),  # −10 · 10 · (0.5, −1): the factors multiply
    ],
)
def test_sign_flip_and_scaling_on_deltas(kinds: list[str], expected: list[float]) -> None:
    attacker = Attacker(kinds, [1, 4], num_classes=10, seed=0, scale=10.0)
    out = attacker.update(delta([0.5, -1.0]), START, rnd=1, client_id=4)
    assert out.tensors["w"].tolist() == expected
    assert out.tensors["n"].item() == 5 and torch.equal(out.extras["c"], torch.ones(1))  # counters, extras: untouched
    assert out.num_examples == 7
    honest = delta([0.5, -1.0])
    assert attacker.update(honest, START, rnd=1, client_id=2) is honest  # not an attacker


def test_weight_updates_are_attacked_through_their_delta() -> None:
    attacker = Attacker(["sign_flip"], [0], num_classes=10, seed=0, scale=2.0)
    out = attacker.update(delta([1.5, 1.0], UpdateKind.WEIGHTS), START, rnd=1, client_id=0)
    assert out.tensors["w"].tolist() == [0.0, 4.0]  # 1 − 2·0.5, 2 − 2·(−1)


def test_noise_is_seeded_by_run_round_and_client() -> None:
    attacker = Attacker(["noise"], [0, 1], num_classes=10, seed=3, std=0.1)
    first = attacker.update(delta([0.0, 0.0]), START, rnd=2, client_id=0).tensors["w"]
    assert torch.equal(first, attacker.update(delta([0.0, 0.0]), START, rnd=2, client_id=0).tensors["w"])
    assert not torch.equal(first, attacker.update(delta([0.0, 0.0]), START, rnd=3, client_id=0).tensors["w"])
    assert not torch.equal(first, attacker.update(delta([0.0, 0.0]), START, rnd=2, client_id=1).tensors["w"])
    assert 0 < float(first.abs().max()) < 1.0  # N(0, 0.01) entries


def test_label_flip_and_inflated_counts() -> None:
    attacker = Attacker(["label_flip", "inflate_examples"], [2], num_classes=4, seed=0, examples=10**6)
    y = torch.tensor([0, 1, 2, 3])
    assert attacker.labels(2, y).tolist() == [3, 2, 1, 0] and attacker.labels(1, y) is y
    out = attacker.update(delta([0.5, -1.0]), START, rnd=1, client_id=2)
    assert out.num_examples == 10**6 and out.tensors["w"].tolist() == [0.5, -1.0]


def runtime(tmp_path: Path, *overrides: str):  # type: ignore[no-untyped-def]
    config = config_mod.load(None, ["clients=4", "task.partition=iid", "local.epochs=1", f"output_dir={tmp_path}",
                                    *overrides])
    task = build_task(config)
    return build_client_runtime(config, task, build_chains(config), ClientStateStore()), task


def test_the_client_runtime_attacks_as_configured(tmp_path: Path) -> None:
    honest, task = runtime(tmp_path)
    attacking, _ = runtime(tmp_path, "attacks.kind=sign_flip", "attacks.scale=10", "attacks.clients=[1]")
    torch.manual_seed(0)
    params = {k: v.detach().clone() for k, v in task.make_model().state_dict().items()}

    def train(rt, cid: int) -> Update:  # type: ignore[no-untyped-def]
        reply = rt.handle(Message(1, cid, Instruction(1, TaskKind.TRAIN, Work(cid, 16), params)))
        return reply.body

    for cid, factor in ((0, 1.0), (1, -10.0)):
        expected, got = train(honest, cid), train(attacking, cid)
        for name, tensor in expected.tensors.items():
            torch.testing.assert_close(got.tensors[name], tensor * factor if tensor.is_floating_point() else tensor)


def test_robust_rules_resist_two_flipped_and_scaled_updates() -> None:
    """Eight honest deltas 1.0 ± 0.1, two attackers sending −10 × their delta of 1.0."""
    honest = [1.0, 0.9, 1.1, 1.0, 0.95, 1.05, 0.9, 1.1]
    attacker = Attacker(["sign_flip"], [8, 9], num_classes=10, seed=0, scale=10.0)
    updates = [delta([v, v]) for v in honest] + [
        attacker.update(delta([1.0, 1.0]), START, rnd=1, client_id=cid) for cid in (8, 9)
    ]
    tensors = [{"w": u.tensors["w"]} for u in updates]
    weights = [1.0] * 10
    mean = float(weighted_average(tensors, weights)["w"][0])
    assert mean == pytest.approx((sum(honest) - 20) / 10)  # −1.2: the wrong way
    # sorted: −10, −10, 0.9, 0.9, 0.95, 1.0, 1.0, 1.05, 1.1, 1.1
    assert float(coordinate_median(tensors, weights)["w"][0]) == pytest.approx((0.95 + 1.0) / 2)
    # two dropped at each end
    assert float(trimmed_mean(tensors, weights, fraction=0.2)["w"][0]) == pytest.approx(
        (0.9 + 0.9 + 0.95 + 1.0 + 1.0 + 1.05) / 6
    )
    kept = multi_krum(tensors, weights, byzantine=2, select=None)
    assert set(kept.kept) == set(range(8))  # both attackers discarded
    assert float(kept["w"][0]) == pytest.approx(sum(honest) / 8)
