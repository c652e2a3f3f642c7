"""One worker of a data-parallel job started by torchrun, on one host or many.

Every process torchrun starts (``torchrun ... -m fedweave.data_parallel CONFIG``) is a
worker of the same job: its rank, the world's size and its local rank come from the
environment torchrun sets, and the process group is formed with ``env://`` on
torchrun's rendezvous, not on a store of our own. The step is the synchronous one of
:mod:`fedweave.data_parallel.bsp`, unchanged: the controller, the global sampler and the
b_i / B weighting are the same on many hosts as on one.

All workers agree on the run directory without talking: ``--run-dir``, else
``<output_dir>/<name>-<TORCHELASTIC_RUN_ID>`` (the rendezvous id; on storage every host
sees). Rank 0 creates it, writes the metrics, the checkpoints and the model.

World changes are torchrun's: when a host dies or a new one arrives, its agents stop
every worker and start them again with a new world. A worker that stops (its collective
broke, or torchrun's SIGTERM, answered at the next step boundary) leaves the job's state
behind first: the first worker of each host writes its state at its last completed step
into the checkpoint when that is ahead of the saved one. The restarted workers take the
state of the most advanced among them (the saved checkpoint, on shared storage: rank 0
also writes one every ``data_parallel.checkpoint_every`` steps, which bounds the steps a
job loses when no worker could save), the controller replans over the new world, and
training goes on from the sampler's saved position, so each epoch still covers every
sample once. The in-place re-formation of :mod:`fedweave.data_parallel.elastic` stays the
path of a job whose workers one launcher started on one host.

Each host's torchrun agent is best started by ``fedweave worker CONFIG --nnodes N
--rdzv-endpoint HOST:PORT`` (:mod:`fedweave.deploy.torchrun`), which works where a machine's
hostname resolves to 127.0.0.1.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import torch

from fedweave import rundir
from fedweave.checkpoint import CHECKPOINT, load_checkpoint
from fedweave.config import Config
from fedweave.data_parallel.bsp import Worker
from fedweave.data_parallel.group import DataParallelError, Group, PeerFailure
from fedweave.data_parallel.records import save_checkpoint
from fedweave.data_parallel.workers import Shared
from fedweave.errors import CheckpointError, ConfigError, first_line
from fedweave.liveness import heartbeat
from fedweave.rundir import CONFIG_FILE, METRICS_FILE

log = logging.getLogger(__name__)

ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
"""What torchrun sets for every worker (and ``env://`` reads)."""


class WorkerStopped(DataParallelError):
    """This worker stopped with the job's state saved (its group broke, or torchrun stopped it):
    torchrun starts the workers again, within ``--max-restarts``."""


@dataclass(frozen=True)
class TorchrunEnv:
    """Where this process stands in the torchrun job."""

    rank: int
    world_size: int
    local_rank: int
    group_rank: int  # the host's (agent's) rank
    restart_count: int
    run_id: str

    @classmethod
    def read(cls, environ: Mapping[str, str]) -> TorchrunEnv:
        missing = [name for name in ENV if name not in environ]
        if missing:
            raise DataParallelError(
                f"not started by torchrun: {', '.join(missing)} unset (run `torchrun ... -m fedweave.data_parallel "
                "CONFIG`)"
            )
        numbers = {"RANK": None, "WORLD_SIZE": None, "LOCAL_RANK": None, "GROUP_RANK": "0",
                   "TORCHELASTIC_RESTART_COUNT": "0"}
        for name, default in numbers.items():
            value = environ.get(name, default)
            if value is None or not (value.isascii() and value.isdigit()):
                raise DataParallelError(f"{name}={value!r}: torchrun sets it to a whole number 0 or more")
        env = cls(
            rank=int(environ["RANK"]),
            world_size=int(environ["WORLD_SIZE"]),
            local_rank=int(environ["LOCAL_RANK"]),
            group_rank=int(environ.get("GROUP_RANK", "0")),
            restart_count=int(environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            run_id=environ.get("TORCHELASTIC_RUN_ID", "none"),
        )
        if env.rank >= env.world_size:
            raise DataParallelError(f"RANK={env.rank} is not a rank of a world of WORLD_SIZE={env.world_size} "
                                    f"(ranks 0..{env.world_size - 1})")
        return env


def agreed_run_dir(config: Config, env: TorchrunEnv, run_dir: str | Path | None = None) -> Path:
    """The run directory every worker of the job names alike: ``run_dir``, else
    ``<output_dir>/<name>-<rendezvous id>``."""
    return Path(run_dir) if run_dir is not None else Path(config.output_dir) / f"{config.name}-{env.run_id}"


def backend_for(config: Config) -> str:
    """gloo, or NCCL (``backend: nccl``, or ``auto`` where CUDA is present; one GPU per local rank)."""
    backend = config.data_parallel.backend
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return backend


def saved_step(run_dir: Path) -> int:
    """The step of the checkpoint in ``run_dir`` (-1: none)."""
    try:
        return int(load_checkpoint(run_dir)["round"])
    except CheckpointError:
        return -1


def run(config: Config, run_dir: str | Path | None = None, environ: Mapping[str, str] | None = None) -> Path:
    """Be the worker of rank ``RANK`` of the torchrun job; its run directory once the run is done.

    Raises :class:`DataParallelError` when this worker's group broke or torchrun stopped
    it (its state is saved first): torchrun then starts the workers anew, within
    ``--max-restarts``.
    """
    if config.mode != "data_parallel" or config.data_parallel.sync != "bsp":
        raise ConfigError("config key 'mode': torchrun workers train mode data_parallel with data_parallel.sync bsp")
    environ = os.environ if environ is None else environ
    with heartbeat(config.grpc.heartbeat_interval, environ):  # FEDWEAVE_HEARTBEAT's file, while it trains
        return _run(config, TorchrunEnv.read(environ), run_dir)


def _run(config: Config, env: TorchrunEnv, run_dir: str | Path | None) -> Path:
    path = agreed_run_dir(config, env, run_dir)
    backend = backend_for(config)
    members = list(range(env.world_size))
    device = torch.device(f"cuda:{env.local_rank}") if backend == "nccl" else torch.device("cpu")
    group = Group(None, env.restart_count, members, env.rank, backend, config.data_parallel.timeout, device)
    if env.rank == 0:
        try:
            rundir.lock(path)  # the job's writer: a second job on the run directory is refused
        except BaseException:
            group.close()
            raise
    if env.rank == 0 and not (path / CONFIG_FILE).exists():
        rundir.create(config, path)
    resume = load_checkpoint(path)["state"] if (path / CHECKPOINT).exists() else None
    shared = Shared(config=config, run_dir=path, members=members, backend=backend, resume=resume,
                    local_rank=env.local_rank)
    worker = Worker(env.rank, shared)

    def stop(signum: int, frame: FrameType | None) -> None:
        worker.stop_requested = True  # answered at the next step boundary

    signal.signal(signal.SIGTERM, stop)
    log.info("worker %d of %d (host %d, restart %d) in %s", env.rank, env.world_size, env.group_rank,
             env.restart_count, path)
    try:
        worker.adopt(group)
        if env.rank == 0 and (path / METRICS_FILE).exists():
            rundir.records_until(path, "step", worker.step)  # the steps after the state taken are redone
        worker.train(group)
        if worker.stop_requested:
            raise PeerFailure("stopped by torchrun (SIGTERM)")
    except PeerFailure as exc:
        if env.local_rank == 0 and (path / CONFIG_FILE).exists() and worker.step > saved_step(path):
            save_checkpoint(path, worker.step, worker.state_dict())
            log.info("worker %d: saved the job's state after step %d", env.rank, worker.step)
        raise WorkerStopped(f"worker {env.rank} stopped at step {worker.step}: {first_line(exc)}; torchrun "
                            "starts the workers again (within --max-restarts)") from None
    finally:
        group.close()
        rundir.release(path)
    return path
