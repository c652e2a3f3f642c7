"""Joining the torch.distributed world: the rendezvous and the backend choice."""

from __future__ import annotations

import pytest

from fedweave.config import TorchDistConfig
from fedweave.errors import ConfigError
from fedweave.transports.torchdist.world import Rendezvous, choose_backend, rendezvous


def test_rendezvous_from_torchrun_slurm_and_config() -> None:
    cfg = TorchDistConfig()
    torchrun = {
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "1234",
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
    }
    assert rendezvous(cfg, torchrun) == Rendezvous("10.0.0.1", 1234, 3, 4, 1)
    slurm = {
        "SLURM_PROCID": "2",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "0",
        "SLURM_LAUNCH_NODE_IPADDR": "10.1.1.1",
    }
    assert rendezvous(cfg, slurm) == Rendezvous("10.1.1.1", 29500, 2, 8, 0)
    configured = TorchDistConfig(address="192.168.0.9", port=4321)
    assert rendezvous(configured, torchrun) == Rendezvous("192.168.0.9", 4321, 3, 4, 1)
    assert rendezvous(cfg, {}, rank=0, world_size=2).address == "127.0.0.1"
    with pytest.raises(ConfigError, match="torchrun"):
        rendezvous(cfg, {})
    with pytest.raises(ConfigError, match="outside"):
        rendezvous(cfg, {"RANK": "4", "WORLD_SIZE": "4"})


def test_backend_choice() -> None:
    assert choose_backend("auto", cuda=False) == "gloo"
    assert choose_backend("gloo", cuda=True) == "gloo"
    with pytest.raises(ConfigError, match="nccl"):
        choose_backend("nccl", cuda=False)
