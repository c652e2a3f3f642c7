"""The same config run in memory and as gRPC processes (launcher=process) gives the same model.

Every process derives the same partition and initial model from the seed, clients train
with the same seeded generators, and the server aggregates the replies in the order of
its messages, so the runs agree to the bit in practice (the test allows 1e-5). SCAFFOLD
is the stateful algorithm: each client process keeps its control variate across rounds.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import assert_same_params, run_to_end

COMMON = ["clients=2", "rounds=3", "eval.federated_every=3"]


@pytest.mark.parametrize("strategy", ["fedavg", "scaffold"])
def test_grpc_processes_match_the_in_memory_run(strategy: str, tmp_path: Path) -> None:
    memory, memory_records = run_to_end(tmp_path / "memory", *COMMON, f"strategy={strategy}")
    grpc, grpc_records = run_to_end(
        tmp_path / "grpc", *COMMON, f"strategy={strategy}", "transport=grpc", "launcher=process"
    )
    assert_same_params(memory, grpc, atol=1e-5)
    assert len(grpc_records) == 3
    for a, b in zip(memory_records, grpc_records):
        assert b["clients_completed"] == a["clients_completed"] == 2
        for key in ("train_loss", "test_loss", "test_accuracy", "federated_accuracy"):
            assert (a.get(key) is None) == (b.get(key) is None), key
            if a.get(key) is not None:
                assert b[key] == pytest.approx(a[key], abs=1e-6), key


def test_power_of_choice_over_grpc_selects_as_in_memory_and_bytes_are_payload_and_wire(tmp_path: Path) -> None:
    """The losses it ranks by come from the clients' updates, counted for their authenticated ids: the
    same clients train in every round. bytes_* are the payload, equal in both; gRPC adds wire_bytes_*."""
    overrides = ["clients=4", "rounds=3", "sample_fraction=0.5", "selection=power_of_choice",
                 "task.partition={scheme: dirichlet, alpha: 0.3}"]
    memory, memory_records = run_to_end(tmp_path / "memory", *overrides)
    grpc, grpc_records = run_to_end(tmp_path / "grpc", *overrides, "transport=grpc", "launcher=process")
    assert_same_params(memory, grpc, atol=1e-5)
    for a, b in zip(memory_records, grpc_records, strict=True):
        assert [c["id"] for c in b["clients"]] == [c["id"] for c in a["clients"]]
        assert (b["bytes_sent"], b["bytes_received"]) == (a["bytes_sent"], a["bytes_received"])
        assert b["wire_bytes_sent"] > b["bytes_sent"] and b["wire_bytes_received"] > b["bytes_received"]
        assert "wire_bytes_sent" not in a
