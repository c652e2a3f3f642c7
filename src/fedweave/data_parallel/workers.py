"""Setting up the worker processes: what each gets from the launcher, its backend, device,
threads and emulated speed, the dataset and model it builds, and how they are started.

Workers are forked when no GPU is present (instant: torch is not imported again and
the dataset preloaded by the launcher is shared), spawned otherwise
(:func:`resolve_backend`); each waits on a pipe for the address of the run's store.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedweave import config as config_mod
from fedweave.emulation import Emulator, worker_threads
from fedweave.config import Config
from fedweave.data_parallel.group import BadSteps, Stopped
from fedweave.errors import ConfigError
from fedweave.training import LocalOptimizer, LocalSettings
from fedweave.task import Dataset, build_model, load_dataset


@dataclass
class Shared:
    """What every worker gets from the launcher."""

    config: Config
    run_dir: Path
    members: list[int]
    backend: str
    resume: dict[str, Any] | None = None
    dataset: Dataset | None = None  # preloaded by the launcher when the workers are forked
    local_rank: int | None = None  # under torchrun: the worker's index on its host (its GPU); else its id


def resolve_backend(config: Config) -> tuple[str, str]:
    """(backend, start method): NCCL when CUDA has a GPU per worker, else gloo.

    Workers are forked (instant: torch is not imported again, the dataset is shared)
    unless CUDA is present: a CUDA build's autograd engine starts device threads at
    the caller's first backward pass, after which a forked child cannot run autograd,
    so with CUDA the workers are spawned.
    """
    backend = config.data_parallel.backend
    cuda = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if cuda else 0
    workers = config.data_parallel_workers
    if backend == "nccl" and gpus < workers:
        raise ConfigError(
            f"config key 'data_parallel.backend': nccl needs a GPU per worker; {workers} workers, {gpus} GPUs"
        )
    if backend == "auto":
        backend = "nccl" if gpus >= workers else "gloo"
    return backend, ("spawn" if cuda else "fork")


def make_optimizer(model: nn.Module, dp: config_mod.DataParallelConfig) -> LocalOptimizer:
    """The optimiser of ``data_parallel`` (the same step on every worker, or on the parameter server)."""
    return LocalOptimizer(
        model.parameters(),
        LocalSettings(optimizer=dp.optimizer, lr=dp.lr, momentum=dp.momentum, weight_decay=dp.weight_decay),
    )


def worker_setup(worker: int, shared: Shared) -> tuple[Emulator, torch.device, Dataset]:
    """What every worker process starts with: its threads, its emulated speed, its device
    (its own GPU with NCCL) and the dataset (inherited when forked, else loaded)."""
    cfg = shared.config
    threads = worker_threads(cfg.heterogeneity, worker, cfg.threads)
    if threads:
        torch.set_num_threads(threads)
    emulator = Emulator(cfg.heterogeneity, worker, threads or torch.get_num_threads())
    gpu = worker if shared.local_rank is None else shared.local_rank
    device = torch.device(f"cuda:{gpu}") if shared.backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return emulator, device, shared.dataset or load_data(cfg)


def load_data(config: Config) -> Dataset:
    task = config.task
    return load_dataset(
        task.dataset, seed=config.seed, test_fraction=task.test_fraction, root=task.data_root,
        options=task.dataset_options, kind=task.kind,
    )


def make_model(config: Config, dataset: Dataset) -> nn.Module:
    return build_model(
        config.task.model, input_shape=dataset.input_shape, num_classes=dataset.num_classes,
        options=config.task.model_options,
    )


def worker_process(
    worker: int, shared: Shared, port_conn: Any, run: Callable[[tuple[str, int]], None], logger: logging.Logger
) -> None:
    """The body of a worker process: wait (bounded) for the store's address on ``port_conn``,
    then ``run(address)``. Exits with 4 when no address comes, 3 when the run stopped it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the launcher, which stops the workers
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if not port_conn.poll(shared.config.data_parallel.timeout):
        raise SystemExit(4)
    address = port_conn.recv()
    try:
        run(address)
    except (Stopped, BadSteps) as exc:
        logger.error("worker %d: %s", worker, exc)
        raise SystemExit(3) from None


def spawn_workers(
    ctx: Any, ids: Sequence[int], target: Callable[..., None], args: Callable[[int, Any], tuple], name: str
) -> tuple[dict[int, Any], dict[int, Any]]:
    """One process per worker id, each waiting on its pipe for the store's address
    (:func:`release_workers`); ``args(id, pipe)`` are the target's arguments."""
    procs: dict[int, Any] = {}
    conns: dict[int, Any] = {}
    for w in ids:
        receive, send = ctx.Pipe(duplex=False)
        procs[w] = ctx.Process(target=target, args=args(w, receive), name=f"{name}-{w}")
        procs[w].start()
        conns[w] = send
    return procs, conns


def release_workers(conns: Mapping[int, Any], ids: Sequence[int], port: int) -> None:
    """Send the store's address to the workers ``ids``: they start."""
    for w in ids:
        conns[w].send(("127.0.0.1", port))
        conns[w].close()
