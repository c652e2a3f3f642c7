"""Joining the torch.distributed world: the rendezvous (config, torchrun, Slurm), the backend
(gloo or NCCL) and the process groups of the sites."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from fedweave.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass
class Rendezvous:
    """Where and as whom a process joins the torch.distributed world."""

    address: str
    port: int
    rank: int
    world_size: int
    local_rank: int = 0


def _env_int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            try:
                return int(value)  # type: ignore[arg-type]
            except ValueError:
                raise ConfigError(
                    f"environment variable {name}={value!r} is not an integer"
                ) from None
    return None


def rendezvous(
    cfg: Any,
    env: Mapping[str, str] | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
) -> Rendezvous:
    """The rendezvous from ``cfg`` (``TorchDistConfig``), then arguments, then torchrun / Slurm variables."""
    env = os.environ if env is None else env
    rank = rank if rank is not None else _env_int(env, "RANK", "SLURM_PROCID")
    world_size = (
        world_size
        if world_size is not None
        else _env_int(env, "WORLD_SIZE", "SLURM_NTASKS")
    )
    if rank is None or world_size is None:
        raise ConfigError(
            "torchdist rendezvous: rank and world size are unknown; start the process with torchrun "
            "(RANK, WORLD_SIZE) or srun (SLURM_PROCID, SLURM_NTASKS), or pass them explicitly"
        )
    if not 0 <= rank < world_size:
        raise ConfigError(
            f"torchdist rendezvous: rank {rank} is outside 0..{world_size - 1}"
        )
    address = (
        cfg.address
        or env.get("MASTER_ADDR")
        or env.get("SLURM_LAUNCH_NODE_IPADDR")
        or "127.0.0.1"
    )
    port = cfg.port if cfg.port is not None else _env_int(env, "MASTER_PORT")
    local_rank = _env_int(env, "LOCAL_RANK", "SLURM_LOCALID") or 0
    return Rendezvous(
        address, 29500 if port is None else port, rank, world_size, local_rank
    )


def choose_backend(requested: str, cuda: bool | None = None) -> str:
    """``auto``: NCCL when CUDA (and NCCL) are available, else gloo; ``nccl`` without CUDA is refused."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    nccl = cuda and dist.is_nccl_available()
    if requested == "auto":
        return "nccl" if nccl else "gloo"
    if requested == "nccl" and not nccl:
        raise ConfigError(
            "config key 'torchdist.backend': nccl needs CUDA devices and a torch built with NCCL; use gloo"
        )
    return requested


class World:
    """This process's membership of the torch.distributed world, and the site groups in it."""

    def __init__(self, cfg: Any, rdv: Rendezvous, backend: str | None = None):
        self.cfg = cfg
        self.rdv = rdv
        self.backend = choose_backend(backend or cfg.backend)
        self.device = (
            torch.device("cuda", rdv.local_rank)
            if self.backend == "nccl"
            else torch.device("cpu")
        )
        self.bucket_bytes = max(1, int(cfg.bucket_mb * (1 << 20)))
        dist.init_process_group(
            self.backend,
            init_method=f"tcp://{rdv.address}:{rdv.port}",
            rank=rdv.rank,
            world_size=rdv.world_size,
            timeout=timedelta(seconds=cfg.timeout),
        )
        log.info(
            "torchdist: rank %d of %d joined (%s)",
            rdv.rank,
            rdv.world_size,
            self.backend,
        )

    def site_groups(self, sites: Sequence[Sequence[int]]) -> list[tuple[Any, Any]]:
        """Per site (lists of global ranks, leader first): its process group for data, whose
        collectives are bounded by ``torchdist.timeout``, and a control group bounded by
        ``torchdist.idle_timeout`` on which members wait for the next round. Every rank must call this."""
        idle = timedelta(seconds=self.cfg.idle_timeout)
        return [
            (
                dist.new_group(list(ranks), backend=self.backend),
                dist.new_group(list(ranks), backend=self.backend, timeout=idle),
            )
            for ranks in sites
        ]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
