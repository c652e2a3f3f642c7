"""The process group of one generation of workers, the run's TCP store, and how a run fails.

A collective that breaks (a peer died, hung past the timeout, or left) raises
:class:`PeerFailure`, which the worker answers by reporting to the launcher and forming
the next generation (:mod:`fedweave.data_parallel.elastic`); :class:`Stopped` ends a
worker's part in the run; :class:`DataParallelError` is what a user sees when the run
cannot go on.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

import torch
import torch.distributed as dist

from fedweave.errors import FedweaveError, first_line

log = logging.getLogger(__name__)


class DataParallelError(FedweaveError):
    """A data-parallel run could not continue (too few workers left, a worker failed to start)."""


class PeerFailure(Exception):
    """A collective failed: a peer died, hung past the timeout, or left."""


class BadSteps(DataParallelError):
    """Too many steps were skipped for a non-finite or too large gradient (``data_parallel.max_bad_steps``)."""


class Stopped(Exception):
    """The launcher ended this worker's part in the run (too few survivors, or excluded)."""


class Group:
    """One generation of the process group: ``members`` (worker ids, sorted) joined under
    the store prefix of generation ``gen``; rank = position of this worker in ``members``.
    Without a store the group is torchrun's: its rendezvous, from the environment (``env://``)."""

    def __init__(
        self, store: dist.Store | None, gen: int, members: list[int], worker: int, backend: str, timeout: float,
        device: torch.device,
    ):
        self.gen = gen
        self.members = members
        self.rank = members.index(worker)
        self.size = len(members)
        self.device = device
        where = {"init_method": "env://"} if store is None else {"store": dist.PrefixStore(f"gen{gen}/", store)}
        try:
            dist.init_process_group(
                backend,
                **where,
                rank=self.rank,
                world_size=self.size,
                timeout=datetime.timedelta(seconds=timeout),
            )
        except Exception as exc:  # a member that never arrives times the rendezvous out
            raise PeerFailure(f"forming generation {gen} failed: {exc}") from exc

    def all_reduce(self, tensor: torch.Tensor) -> None:
        try:
            dist.all_reduce(tensor)
        except Exception as exc:
            raise PeerFailure(first_line(exc)) from exc

    def broadcast_object(self, obj: Any, src: int) -> Any:
        box = [obj]
        try:
            dist.broadcast_object_list(box, src=src, device=self.device if self.device.type == "cuda" else None)
        except Exception as exc:
            raise PeerFailure(first_line(exc)) from exc
        return box[0]

    def close(self) -> None:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as exc:  # a broken group may not tear down cleanly; it is dropped anyway
                log.debug("destroying generation %d: %s", self.gen, exc)


def launcher_store(timeout: float) -> dist.TCPStore:
    """The run's TCP store, held by the launcher on a free loopback port."""
    return dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout)
    )


def worker_store(address: tuple[str, int], timeout: float) -> dist.TCPStore:
    """A worker's client of the run's TCP store at ``address``."""
    return dist.TCPStore(*address, is_master=False, timeout=datetime.timedelta(seconds=timeout))

