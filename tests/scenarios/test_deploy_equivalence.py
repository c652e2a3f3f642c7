"""The same config run in memory and as gRPC processes (launcher=process) gives the same model.

Every process derives the same partition and initial model from the seed, clients train
with the same seeded generators, and the server aggregates the replies in the order of
its messages, so the runs agree to the bit in practice (the test allows 1e-5). SCAFFOLD
is the stateful algorithm: each client process keeps its control variate across rounds.
FedAvg's run is the power-of-choice one: its metrics, federated evaluation included, its
selection and its payload bytes each equal the in-memory run's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import assert_same_params, run_to_end


def assert_same_records(memory: list[dict[str, Any]], grpc: list[dict[str, Any]], completed: int) -> None:
    """One record per round each, the same clients completed and the same metrics."""
    assert len(grpc) == len(memory) == 3
    for a, b in zip(memory, grpc, strict=True):
        assert b["clients_completed"] == a["clients_completed"] == completed
        for key in ("train_loss", "test_loss", "test_accuracy", "federated_accuracy"):
            assert (a.get(key) is None) == (b.get(key) is None), key
            if a.get(key) is not None:
                assert b[key] == pytest.approx(a[key], abs=1e-6), key
    assert memory[-1]["federated_accuracy"] is not None  # the federated evaluation ran, and was compared


def test_scaffold_grpc_processes_match_the_in_memory_run(tmp_path: Path) -> None:
    common = ["clients=2", "rounds=3", "eval.federated_every=3", "strategy=scaffold"]
    memory, memory_records = run_to_end(tmp_path / "memory", *common)
    grpc, grpc_records = run_to_end(tmp_path / "grpc", *common, "transport=grpc", "launcher=process")
    assert_same_params(memory, grpc, atol=1e-5)
    assert_same_records(memory_records, grpc_records, 2)


def test_fedavg_with_power_of_choice_over_grpc_matches_the_in_memory_run_and_bytes_are_payload_and_wire(
    tmp_path: Path,
) -> None:
    """FedAvg's metrics (and federated evaluation) equal the in-memory run's. The losses power of choice
    ranks by come from the clients' updates, counted for their authenticated ids: the same clients train
    in every round. bytes_* are the payload, equal in both; gRPC adds wire_bytes_*."""
    overrides = ["clients=4", "rounds=3", "sample_fraction=0.5", "selection=power_of_choice", "strategy=fedavg",
                 "task.partition={scheme: dirichlet, alpha: 0.3}", "eval.federated_every=3"]
    memory, memory_records = run_to_end(tmp_path / "memory", *overrides)
    grpc, grpc_records = run_to_end(tmp_path / "grpc", *overrides, "transport=grpc", "launcher=process")
    assert_same_params(memory, grpc, atol=1e-5)
    assert_same_records(memory_records, grpc_records, 2)
    for a, b in zip(memory_records, grpc_records, strict=True):
        assert [c["id"] for c in b["clients"]] == [c["id"] for c in a["clients"]]
        assert (b["bytes_sent"], b["bytes_received"]) == (a["bytes_sent"], a["bytes_received"])
        assert b["wire_bytes_sent"] > b["bytes_sent"] and b["wire_bytes_received"] > b["bytes_received"]
        assert "wire_bytes_sent" not in a
