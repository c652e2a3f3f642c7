"""The seam for plugins the server combines while encoded (secure aggregation, HE)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from conftest import assert_same_params, run_to_end, small_config
from fedweave.errors import ConfigError, NothingTrained, RoundError
from fedweave.types import Update, UpdateKind

SEEN: list[int] = []


@dataclass
class ScaledSumHParams:
    fail: bool = False


class ScaledSum:
    """Clients send n_k · Δ_k; the server only ever sums, then divides by Σ n_k."""

    name = "scaled_sum"
    HParams = ScaledSumHParams
    accepts = frozenset({UpdateKind.DELTA})
    combines_encoded = True

    def __init__(self, hp: ScaledSumHParams):
        self.hp = hp

    def encode(self, payload: Update, ctx) -> Update:
        return replace(payload, tensors={k: v * payload.num_examples for k, v in payload.tensors.items()})

    def combine(self, updates: list[Update], ctx) -> Update:
        SEEN.append(len(updates))
        if self.hp.fail:
            raise RoundError("too few survivors to unmask")
        total = sum(u.num_examples for u in updates)
        summed = {k: sum(u.tensors[k] for u in updates) / total for k in updates[0].tensors}
        return Update(UpdateKind.DELTA, summed, total, applied=list(updates[0].applied))

    def decode(self, payload: Update, ctx) -> Update:
        return replace(payload)


PLUGIN = "plugins.client_send=[{name: test_combine:ScaledSum}]"


def test_combined_sum_equals_fedavg(tmp_path: Path) -> None:
    SEEN.clear()
    plain, _ = run_to_end(tmp_path / "plain")
    combined, records = run_to_end(tmp_path / "combined", PLUGIN)
    assert SEEN == [4, 4, 4]  # one combine per round, over all four clients
    assert all(r["clients_completed"] == 4 for r in records)
    assert_same_params(plain, combined, atol=1e-6)


def test_failed_combine_skips_the_round_and_keeps_the_model(tmp_path: Path) -> None:
    from fedweave import runner

    r = runner.prepare(small_config("plugins.client_send=[{name: test_combine:ScaledSum, fail: true}]"), tmp_path)
    start = {k: v.clone() for k, v in r.params.items()}
    with pytest.raises(NothingTrained):  # every round skipped: the run fails, and writes no model
        runner.execute(r)
    assert len(r.records) == 3 and all(rec["skipped"] for rec in r.records)
    assert_same_params(start, r.params)


def test_combining_plugin_outside_client_send_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"plugins.server_receive\[0\].*belongs in plugins.client_send"):
        small_config("plugins.server_receive=[{name: test_combine:ScaledSum}]")

