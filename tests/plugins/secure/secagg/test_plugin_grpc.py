"""Secure aggregation across processes: ``fedweave server`` and ``fedweave client`` nodes over
gRPC (launcher: process) run the whole message flow, and a client killed after masking is
recovered from its neighbours' shares."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from conftest import assert_same_params, small_config
from fedweave import runner

HERE = Path(__file__).resolve().parent

GRPC = [
    "clients=3",
    "transport=grpc",
    "launcher=process",
    "grpc={heartbeat_interval: 0.2, heartbeat_timeout: 2.0, poll_timeout: 1.0, backoff_max: 1.0}",
    "checkpoint.every=0",
]


def run(tmp: Path, name: str, *overrides: str) -> tuple[dict[str, torch.Tensor], list[dict]]:
    r = runner.prepare(small_config("clients=3", *overrides), tmp / name)
    records = runner.execute(r)
    return r.params, records


def test_fedavg_with_secagg_over_grpc_processes_equals_the_in_memory_run(tmp_path: Path) -> None:
    secagg = "plugins.client_send=[{name: secagg, bits: 48}]"
    deployed, records = run(tmp_path, "grpc", "rounds=2", secagg, *GRPC)
    simulated, sim_records = run(tmp_path, "inmemory", "rounds=2", secagg)
    plain, _ = run(tmp_path, "plain", "rounds=2")
    step = 2 * 4.0 / (2**32 - 1)  # one quantization step of bits 48 (16 bits for max_examples)
    # each run rounds from the OS's secure source: the means differ within a step, which may
    # move a float32 parameter (|w| < 2) by one unit in its last place
    assert_same_params(deployed, simulated, atol=step + 2**-23)
    assert_same_params(deployed, plain, atol=1e-5)
    assert [(r["round"], r["skipped"], r["clients_completed"]) for r in records] == [(1, False, 3), (2, False, 3)]
    for d, s in zip(records, sim_records):  # the key and share traffic crossed the network
        assert d["wire_bytes_received"] > s["bytes_received"] > 0 and d["wire_bytes_sent"] > s["bytes_sent"] > 0


def test_a_client_killed_after_masking_is_recovered_and_the_round_completes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.syspath_prepend(str(HERE))  # the config names the test plugin, in every process
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    caplog.set_level(logging.INFO, logger="fedweave")
    crash = "{name: 'secagg_crash:CrashAfterMasking', client: 1, round: 1, after: 1.5, others_wait: 3.0}"
    deployed, records = run(tmp_path, "grpc", "rounds=1", f"plugins.client_send=[{crash}, {{name: secagg, bits: 48}}]", *GRPC)
    plain, _ = run(tmp_path, "plain", "rounds=1")
    assert [(r["skipped"], r["clients_completed"]) for r in records] == [(False, 3)]  # its update counts
    assert_same_params(deployed, plain, atol=1e-5)
    assert "round 1: client 1 dropped at step unmask" in caplog.text
