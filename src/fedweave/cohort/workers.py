"""Simulation workers: ``simulation.workers`` processes that do the round's client work.

Worker 0 is this process, its clients trained by a :class:`~fedweave.cohort.trainer.CohortTrainer`
of its own client runtime, as with one worker; each other is a process this one spawns
(``torch.multiprocessing``, start method spawn), which builds the task and a client runtime from
the run's config, as a Ray actor does, on its own device: ``local.device``, or with ``cuda`` and
several CUDA devices, ``cuda:i`` round-robin over them (this process's runtime on the first). The
client runtime of this process keeps every client's state and plugin state and opens and closes
every message (:class:`~fedweave.cohort.transport.CohortTransport`); a spawned worker only does the
local work, in cohorts as this process does. Work goes to the least-loaded worker (:func:`assign`:
the largest jobs first, each to the worker with the fewest examples so far), so the assignment
depends only on the round's jobs; this process trains its share while the others train theirs.

The workers are this run's own processes, one trust domain: jobs and answers travel through
torch's multiprocessing queues, packed by :mod:`fedweave.cohort.parcel` (each storage once per
dtype viewing it, small ones by value, large ones in shared memory), never from another party. A client's
outcome does not depend on which worker trained it: its seeds are its own (round, client), and in a
cohort on the fast path for MLPs on a CPU with widths that are multiples of 8 its products are its
own too (:mod:`fedweave.cohort.layered`), so the model is the same bit for bit whatever the number of
workers; otherwise the groups, which differ with the split, make the models differ at float rounding.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import queue
import signal
import time
from typing import Any

import torch
import torch.multiprocessing as mp

from fedweave.cohort.parcel import pack, unpack
from fedweave.cohort.trainer import CohortTrainer, Done, Work
from fedweave.config import Config
from fedweave.errors import FedweaveError
from fedweave.training import round_steps

log = logging.getLogger(__name__)

START_TIMEOUT = 300.0
"""Seconds a worker may take to build its task."""
POLL = 0.5
"""Seconds between checks that the workers are alive while the main process waits for them."""


def worker_device(device: str, index: int) -> str:
    """Worker ``index``'s device for ``local.device`` ``device``: ``cuda`` round-robin over this
    machine's CUDA devices where there are several; any other as it is."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device in ("cuda", "auto") and count > 1:
        return f"cuda:{index % count}"
    return device


def assign(loads: list[int], workers: int) -> list[int]:
    """Each job's worker: the largest loads first (ties: the earlier job), each to the worker with
    the least load so far (ties: the lower index)."""
    totals = [0] * workers
    out = [0] * len(loads)
    for i in sorted(range(len(loads)), key=lambda i: (-loads[i], i)):
        w = min(range(workers), key=lambda w: (totals[w], w))
        out[i] = w
        totals[w] += loads[i]
    return out


def _serve(config: Config, index: int, inbox: Any, outbox: Any) -> None:
    """A worker's life: build the runtime, then do each batch of work sent until told to stop (None)
    or the run's process is gone. Ctrl-C, which signals the terminal's whole process group, is the
    run's process's to handle: it stops its workers (:meth:`WorkerPool.close`)."""
    from fedweave.build import build_chains, build_client_runtime, build_task, use_threads
    from fedweave.federated.client import ClientStateStore

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = multiprocessing.parent_process()
    config = dataclasses.replace(config, local=dataclasses.replace(config.local, device=worker_device(config.local.device, index)))
    use_threads(config)
    try:
        runtime = build_client_runtime(config, build_task(config), build_chains(config), ClientStateStore())
        trainer = CohortTrainer.of(runtime, config)
    except FedweaveError as exc:  # a user's error (a model without room on this worker's device): the run's one line
        outbox.put((index, str(exc)))
        return
    outbox.put((index, "ready"))
    while (message := _next(inbox, parent)) is not None:
        batch = unpack(message)
        indices = [i for i, _ in batch]
        done = trainer.work([w for _, w in batch])
        outbox.put((index, pack([(i, _sendable(d)) for i, d in zip(indices, done)])))
    if parent is not None and not parent.is_alive():
        outbox.cancel_join_thread()  # answers no one will read: the queue's feeder would wait at exit to write them


def _next(inbox: Any, parent: Any) -> Any:
    """The next message to a worker, or None once the run's process (``parent``) is gone: killed
    (kill -9, out of memory), it told no one to stop, and the worker, which holds the queue's
    writing end too, would wait for ever."""
    while True:
        try:
            return inbox.get(timeout=POLL)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                return None


def _sendable(outcome: Done | Exception) -> Done | Exception:
    if isinstance(outcome, Exception):  # not every exception pickles: its type and message do
        return RuntimeError(f"{type(outcome).__name__}: {outcome}")
    return outcome


class WorkerPool:
    """``config.simulation.workers`` processes doing ``runtime``'s clients' work: this one
    (``runtime`` itself) and the others it spawns."""

    def __init__(self, config: Config, runtime: Any):
        context = mp.get_context("spawn")
        self.runtime = runtime
        self.local = CohortTrainer.of(runtime, config)
        self.outbox = context.Queue()
        self.inboxes = [context.Queue() for _ in range(config.simulation.workers - 1)]
        self.processes = [
            context.Process(target=_serve, args=(config, i, inbox, self.outbox), daemon=True, name=f"fedweave-worker-{i}")
            for i, inbox in enumerate(self.inboxes, start=1)
        ]
        self.reason = self.local.reason  # every worker's trainer decides as this one (one config, one device type)
        for p in self.processes:
            p.start()
        try:
            for _ in self.processes:
                index, said = self._get(START_TIMEOUT, "building its task")
                if said != "ready":
                    raise FedweaveError(f"simulation.workers: fedweave-worker-{index} could not build its task: {said}")
        except BaseException:
            self.close()
            raise
        log.info("simulation.workers: this process and %d worker processes ready", len(self.processes))

    def work(self, batch: list[Work]) -> list[Done | Exception]:
        """Each item's outcome, in order, the items spread over the workers (:func:`assign`): the
        others' sent first, then this process's own trained while they train theirs."""
        if not batch:
            return []
        loads = [self._load(cid, instruction) for cid, instruction, _ in batch]
        where = assign(loads, len(self.processes) + 1)
        # every spawned worker's share packed before any is sent: one that cannot be leaves no worker an
        # answer that the next call would take for one of its own
        packed = {w: pack([(i, item) for i, item in enumerate(batch) if where[i] == w]) for w in sorted(set(where) - {0})}
        for w, data in packed.items():
            self.inboxes[w - 1].put(data)
        out: list[Done | Exception | None] = [None] * len(batch)
        own = [i for i in range(len(batch)) if where[i] == 0]
        try:
            for i, outcome in zip(own, self.local.work([batch[i] for i in own])):
                out[i] = outcome
        finally:  # the others' answers are taken whatever happened here: none may be read as a later round's
            for _ in packed:
                _, answers = self._get(None, "doing its clients' work")
                for i, outcome in unpack(answers):
                    out[i] = outcome
        return out  # type: ignore[return-value]

    def _load(self, cid: int, instruction: Any) -> int:
        """Examples a job goes through: its steps times its batch."""
        work = instruction.work
        n = self.runtime.data.train_size(cid)
        return round_steps(work, n) * min(work.batch_size, n)

    def _get(self, timeout: float | None, what: str) -> Any:
        """The next message of a worker, failing when one has died (or, with ``timeout``, took longer)."""
        started = time.monotonic()
        while timeout is None or time.monotonic() - started < timeout:
            try:
                return self.outbox.get(timeout=POLL)
            except queue.Empty:
                dead = [f"{p.name} (exit code {p.exitcode})" for p in self.processes if not p.is_alive()]
                if dead:
                    raise FedweaveError(
                        f"simulation.workers: {', '.join(dead)} stopped before it had finished {what}"
                    ) from None
        raise FedweaveError(f"simulation.workers: a worker took more than {timeout:g} s {what}")

    def close(self) -> None:
        """Stop the workers (each told to, then waited for a bounded time, then ended), and drop
        what is left for them: a dead worker's share still in its queue's pipe would keep this
        process from exiting (the queue's feeder thread waits at exit to write it all)."""
        for inbox, p in zip(self.inboxes, self.processes):
            if p.is_alive():
                inbox.put(None)
        for p in self.processes:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        for inbox in self.inboxes:
            inbox.cancel_join_thread()
