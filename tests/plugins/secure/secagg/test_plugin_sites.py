"""Secure aggregation through hierarchical deployments whose site links are torch.distributed.

Four clients in two sites of two, FedAvg, two rounds. SecAgg's control steps (key set-up,
unmasking) reach each member through its site and its answers come back relayed; the
masked updates are relayed too, never averaged by a site (only the server may combine
them, while masked). The unmasked sum is the star's: the masks cancel exactly and, at 48 bits,
the quantization step is 2e-9 (its stochastic rounding comes from each client's secure
source, so no two runs round alike), so the global model equals the in-memory star's (≤ 1e-5).

- one torch.distributed world (as under torchrun): this process is rank 0, the server and
  the gloo leader of both sites, four member processes;
- mixed protocols (``launcher: process``): a gRPC server, one ``fedweave site`` leader per
  site (one gRPC node each, the gloo leader of its site's own world) and four members.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from conftest import assert_same_params, free_port, run_to_end, site_members, small_config

from fedweave import config as config_mod
from fedweave import runner
from fedweave.build import strategy_class
from fedweave.topologies.deploy import TorchDistHierarchy, world_size
from fedweave.transports.torchdist import Rendezvous, World

SECAGG = ["clients=4", "rounds=2", "strategy=fedavg", "plugins.client_send=[{name: secagg, bits: 48}]"]
SITES = ["topology={kind: hierarchical, sites: 2, inner: torchdist}", "torchdist.timeout=60"]

def test_secagg_through_gloo_sites_of_one_world_equals_the_star(tmp_path: Path) -> None:
    cfg = small_config(*SECAGG, *SITES)
    path = tmp_path / "sites.yaml"
    path.write_text(config_mod.to_yaml(cfg))
    size, port = world_size(cfg), free_port()
    with site_members([path], size, port):
        world = World(cfg.torchdist, Rendezvous("127.0.0.1", port, 0, size))
        try:
            topology = TorchDistHierarchy(cfg, world, strategy_class(cfg), own_world=False)
            assert not any(link.pre_aggregate for link in topology.links)
            r = runner.prepare(cfg, tmp_path / "sites", topology=topology)
            records = runner.execute(r)
        finally:
            world.close()
    star, star_records = run_to_end(tmp_path / "star", *SECAGG)
    assert_same_params(star, r.params, atol=1e-5)
    assert [(x["skipped"], x["clients_completed"]) for x in records] == [(False, 4), (False, 4)]
    assert records[-1]["test_loss"] == pytest.approx(star_records[-1]["test_loss"], abs=1e-5)


def test_secagg_through_grpc_site_leaders_and_gloo_sites_equals_the_star(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="fedweave")  # the nodes log at the launcher's level
    mixed, records = run_to_end(
        tmp_path / "mixed",
        *SECAGG,
        *SITES,
        "transport=grpc",
        "launcher=process",
        "grpc={heartbeat_interval: 0.25, poll_timeout: 0.5}",
        "round_timeout=60",
        "checkpoint.every=0",
    )
    star, star_records = run_to_end(tmp_path / "star", *SECAGG)
    assert_same_params(star, mixed, atol=1e-5)
    assert [(x["skipped"], x["clients_completed"]) for x in records] == [(False, 4), (False, 4)]
    for m, s in zip(records, star_records, strict=True):  # the key set-up and unmasking crossed the network
        assert m["wire_bytes_sent"] > 0 and m["wire_bytes_received"] > 0 and "wire_bytes_sent" not in s
        assert m["bytes_sent"] > 0 and m["bytes_received"] > 0 and s["bytes_sent"] > 0 and s["bytes_received"] > 0
    # what each site leader sent the server per round: its two members' answers to each step
    # (advertise, share, forward), their two masked updates relayed (never one pre-aggregated
    # update), their answers to the unmasking
    steps = ["2 control(s)"] * 3 + ["2 update(s)", "2 control(s)"]
    for site in (0, 1):
        lines = [m for m in caplog.messages if m.startswith(f"[site {site} leader]") and "members answered" in m]
        assert [m.split(": ", 1)[1] for m in lines] == [
            f"site {site}, round {rnd}: 2 of 2 members answered in {sent}" for rnd in (1, 2) for sent in steps
        ]
