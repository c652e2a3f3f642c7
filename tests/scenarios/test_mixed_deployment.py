"""Hierarchical deployments with gloo inside each site give the in-memory run's global model.

Two sites of two clients, every client a member process that builds its runtime from the
same config (and keeps its own SCAFFOLD control variate across rounds).

- gloo sites under an in-process server: this process is rank 0, the server and the
  leader of both sites' process groups. FedAvg is pre-aggregated in each site by a reduce
  (exact weighted sum).
- mixed protocols (``launcher: process``): a ``fedweave server`` process speaks gRPC to two
  ``fedweave site`` leader processes, each ONE gRPC node for its site and the gloo leader of
  its own site's world with two member processes: FedAvg is pre-aggregated in each site (the
  server sends each site the model once and receives one update per site), SCAFFOLD's
  updates are relayed (its control variates must reach the server whole). Every round ends
  with a federated evaluation through the same site jobs: each site is sent the model once,
  and its members' evaluations are relayed, never pre-aggregated.

Each must equal the flat in-memory run (≤ 1e-5; the federated metrics ≤ 1e-6).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from conftest import assert_same_params, free_port, run_to_end, site_members, small_config

from fedweave import config as config_mod
from fedweave import runner
from fedweave.build import strategy_class
from fedweave.topologies.deploy import TorchDistHierarchy, world_size
from fedweave.transports.torchdist import Rendezvous, World
from fedweave.types import params_nbytes

COMMON = [
    "clients=4",
    "rounds=2",
    "topology={kind: hierarchical, sites: 2, inner: torchdist}",
    "torchdist.timeout=60",
    "task.model_options={hidden: [256]}",  # 13 kB of parameters: tensors dominate the metadata
]
STRATEGIES = ["fedavg", "scaffold"]  # a weighted-sum strategy and a stateful one

def test_gloo_sites_match_the_in_memory_run(tmp_path: Path) -> None:
    """One world (as under torchrun): FedAvg pre-aggregated by a reduce in each site (the relay path
    is the gRPC test's)."""
    strategies = ["fedavg"]
    configs = [
        small_config(*COMMON, f"strategy={s}", f"seed={i}")
        for i, s in enumerate(strategies)
    ]
    paths = []
    for s, cfg in zip(strategies, configs):
        path = tmp_path / f"run-{len(paths)}-{s}.yaml"
        path.write_text(config_mod.to_yaml(cfg))
        paths.append(str(path))
    size, port = world_size(configs[0]), free_port()
    with site_members(paths, size, port):
        world = World(configs[0].torchdist, Rendezvous("127.0.0.1", port, 0, size))
        try:
            for i, cfg in enumerate(configs):
                topology = TorchDistHierarchy(
                    cfg, world, strategy_class(cfg), own_world=False
                )
                r = runner.prepare(cfg, tmp_path / f"sites-{i}", topology=topology)
                records = runner.execute(r)
                flat, flat_records = run_to_end(
                    tmp_path / f"flat-{i}", *COMMON[:2], COMMON[-1], f"seed={i}"
                )
                assert_same_params(flat, r.params, atol=1e-5)
                assert [x["skipped"] for x in records] == [False, False]
                # one pre-aggregated update per site, each counting its two clients
                assert records[0]["clients_completed"] == 4
                assert (
                    abs(records[-1]["test_loss"] - flat_records[-1]["test_loss"]) < 1e-5
                )
        finally:
            world.close()
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_grpc_across_gloo_inside_matches_the_in_memory_run(
    tmp_path: Path, strategy: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``launcher: process`` starts the gRPC server, two site leaders and four member processes.
    FedAvg: each site is sent the model once and answers one pre-aggregated update, so the
    server's traffic is two models each way per round, not four. SCAFFOLD: relayed (its
    members keep their control variates across rounds), each site still sent the model once.
    The federated evaluation after each round: the model once more per site, and every
    member's evaluation relayed to the server (the site leaders' logs count them)."""
    caplog.set_level(logging.INFO, logger="fedweave")  # the nodes log at the launcher's level
    mixed, records = run_to_end(
        tmp_path / "mixed",
        *COMMON,
        f"strategy={strategy}",
        "transport=grpc",
        "launcher=process",
        "grpc.heartbeat_interval=0.25",
        "grpc.poll_timeout=0.5",
        "round_timeout=60",
        "eval.federated_every=1",
    )
    flat, flat_records = run_to_end(
        tmp_path / "flat", *COMMON[:2], COMMON[-1], f"strategy={strategy}", "eval.federated_every=1"
    )
    assert_same_params(flat, mixed, atol=1e-5)
    assert [r["clients_completed"] for r in records] == [4, 4]
    model = params_nbytes(flat)
    for r, f in zip(records, flat_records, strict=True):
        # the training job: each of the two sites gets the model once (SCAFFOLD: and the server's
        # control variate from round 2); the evaluation job: the model once more per site; plus
        # metadata. Relayed per member it would be 4 (8) + 4 models.
        models_down = (2 if strategy == "fedavg" or r["round"] == 1 else 4) + 2
        assert models_down * model <= r["bytes_sent"] < (models_down + 0.5) * model
        if strategy == "fedavg":  # one pre-aggregated update per site, and four small evaluations
            assert 2 * model <= r["bytes_received"] < 2.5 * model
        else:  # every member's update and control-variate delta, relayed whole
            assert r["bytes_received"] >= 8 * model
        for key in ("federated_accuracy", "federated_loss"):
            assert r[key] == pytest.approx(f[key], abs=1e-6), key
    assert records[-1]["test_loss"] == pytest.approx(
        flat_records[-1]["test_loss"], abs=1e-5
    )
    # what each site leader sent the server per round: its two members' evaluations, relayed
    # (never one pre-aggregated evaluation), and FedAvg's one pre-aggregated update
    trained = "1 update(s)" if strategy == "fedavg" else "2 update(s)"
    for site in (0, 1):
        lines = [m for m in caplog.messages if m.startswith(f"[site {site} leader]") and "members answered" in m]
        assert [m.split(": ", 1)[1] for m in lines] == [
            f"site {site}, round {rnd}: 2 of 2 members answered in {sent}"
            for rnd in (1, 2)
            for sent in (trained, "2 evaluation(s)")
        ]
