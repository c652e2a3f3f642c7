"""Differential privacy across processes: ``fedweave server`` and ``fedweave client`` nodes over
gRPC (launcher: process). Adaptive central DP's clip norm travels with the instructions and
DP-SGD's ledger is the server's, so a deployment reports the ε of the simulation and stops at
the same target; its noise comes from each process's secure source, so the model differs."""

from __future__ import annotations

from pathlib import Path

import torch

from conftest import small_config
from fedweave import runner

GRPC = [
    "transport=grpc",
    "launcher=process",
    "grpc={heartbeat_interval: 0.2, heartbeat_timeout: 2.0, poll_timeout: 1.0, backoff_max: 1.0}",
    "checkpoint.every=0",
]
ADAPTIVE = "plugins.client_send=[{name: dp_central, clip: 0.05, noise_multiplier: 0.3, adaptive: true, count_noise: 1.0}]"


def dpsgd(target: float | None = None) -> str:
    extra = f", target_epsilon: {target}" if target is not None else ""
    return f"plugins.client_receive=[{{name: dpsgd, noise_multiplier: 1.0, max_grad_norm: 1.0{extra}}}]"


def run(tmp: Path, name: str, *overrides: str) -> tuple[dict[str, torch.Tensor], list[dict]]:
    r = runner.prepare(small_config("clients=3", "rounds=3", ADAPTIVE, *overrides), tmp / name)
    records = runner.execute(r)
    return r.params, records


def test_a_deployment_clips_adaptively_and_stops_at_the_target_epsilon_like_the_simulation(tmp_path: Path) -> None:
    _, free = run(tmp_path, "free", dpsgd())
    eps = [r["dpsgd.epsilon"] for r in free]  # each DP plugin reports its own ε
    assert all(r["dp_central.epsilon"] > 0 for r in free)
    assert eps == sorted(eps) and len(set(eps)) == 3
    target = (eps[1] + eps[2]) / 2  # round 3 would pass it: both runs stop after round 2
    simulated, sim_records = run(tmp_path, "inmemory", dpsgd(target))
    deployed, records = run(tmp_path, "grpc", dpsgd(target), *GRPC)
    assert [r["round"] for r in records] == [r["round"] for r in sim_records] == [1, 2]
    assert [r["dpsgd.epsilon"] for r in records] == eps[:2]  # the server's ledger, from the clients' reports
    clip = [r["clip_norm"] for r in records]
    assert len(set(clip)) == 2 and 0.05 not in clip  # adapted each round, then sent to the clients
    # the noise (and DP-SGD's sampling) comes from each process's secure source, not from the
    # config both runs read: the same config gives another model, and another noisy clip norm
    assert clip != [r["clip_norm"] for r in sim_records]
    assert all(not torch.equal(deployed[k], simulated[k]) for k in deployed if deployed[k].is_floating_point())
