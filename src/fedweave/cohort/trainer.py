"""A batch of client work done by one client runtime, training jobs in vectorised cohorts.

:class:`CohortTrainer` takes the local work of several clients (each ``(client id, instruction as
received, committed state)``, as :meth:`~fedweave.federated.client.ClientRuntime.work` does it for one) and
does it all: the training jobs that may (:mod:`.eligibility`) in groups (:func:`groups`: by their
settings and kind of step, the most steps first, at most ``limit`` clients and ``budget`` bytes
each) with :func:`~fedweave.cohort.vectorised.train_group`, each update made by its strategy's
``finish`` and sent out as the runtime sends it (:meth:`~fedweave.federated.client.ClientRuntime.trained`);
evaluations and the clients that may not train in a cohort are the runtime's own work, one after
another. A reason a client trains on its own is logged once.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fedweave.config import Config
from fedweave.federated.client import ClientRuntime
from fedweave.cohort.eligibility import auto_reason, job_reason, static_reason
from fedweave.cohort.vectorised import group_bytes, group_size, steps_of, train_group
from fedweave.training import ClientJob, LocalStep
from fedweave.types import Evaluation, Instruction, TaskKind, Update

log = logging.getLogger(__name__)

Work = tuple[int, Instruction, dict[str, Any]]  # client id, the instruction as received, its committed state
Done = tuple[Update | Evaluation, dict[str, Any]]  # the body (before client_send) and the new state


@dataclass
class Pending:
    """A training job waiting for its cohort."""

    index: int  # its place in the batch of work
    instruction: Instruction
    job: ClientJob
    step: LocalStep


class CohortTrainer:
    """Does ``runtime``'s clients' work, training in cohorts of at most ``limit`` clients (None:
    ``cohort: auto``, as many as fit ``budget`` bytes, where :func:`auto_reason` does not object);
    ``enabled`` False: one client after another; ``batch_size``: the run's configured batch size
    (``local.batch_size``), which :meth:`width` pads to (None: each batch size to itself)."""

    def __init__(
        self, runtime: ClientRuntime, limit: int | None, budget: int, enabled: bool = True, batch_size: int | None = None
    ):
        self.runtime = runtime
        self.limit = limit
        self.budget = budget
        self.batch_size = batch_size
        self.reason = static_reason(runtime.algorithm, runtime.model, runtime.loss_fn) if enabled else "off"
        if self.reason is None and limit is None:
            self.reason = auto_reason(runtime.model, runtime.device)
        self._told: set[str] = set()
        self._largest: int | None = None  # the most training rows any client of the run has
        if self.reason not in (None, "off"):
            self._tell(f"clients train one after another: {self.reason}")

    @classmethod
    def of(cls, runtime: ClientRuntime, config: Config) -> CohortTrainer:
        """The trainer of a run's ``simulation`` section: ``cohort`` auto (groups as large as
        ``cohort_memory`` allows), off (one client after another) or K, batches padded to the
        widths of ``local.batch_size``."""
        cohort = config.simulation.cohort
        limit = None if cohort in ("auto", "off") else int(cohort)
        return cls(runtime, limit, config.simulation.cohort_memory * 2**20, enabled=cohort != "off",
                   batch_size=config.local.batch_size)

    def work(self, batch: list[Work]) -> list[Done | Exception]:
        """Each item's outcome, in order: what the runtime's ``work`` returns, or the exception it raised."""
        out: list[Done | Exception | None] = [None] * len(batch)
        pending: list[Pending] = []
        training = [i for i, (_, ins, _) in enumerate(batch) if self.reason is None and ins.task is TaskKind.TRAIN]
        jobs = dict(zip(training, self.runtime.cohort_jobs([batch[i] for i in training])))
        for i, (cid, instruction, state) in enumerate(batch):
            try:
                job = jobs.get(i)
                if isinstance(job, Exception):
                    raise job
                if job is not None:
                    why = job_reason(job)
                    if why is None:
                        pending.append(Pending(i, instruction, job, self.runtime.algorithm.local_step(job)))  # type: ignore[attr-defined]
                        continue
                    self._tell(f"client {cid} trains on its own: {why}")
                out[i] = self.runtime.work(cid, instruction, state)
            except Exception as exc:  # one client's failure must not stop the others
                out[i] = exc
        for group in groups(pending, self.limit, self.budget, self.runtime, self.width):
            self._train(group, out)
        return out  # type: ignore[return-value]

    def width(self, batch_size: int) -> int:
        """:func:`batch_width` of ``batch_size`` in this run."""
        if self._largest is None:
            data = self.runtime.data
            self._largest = max((data.train_size(c) for c in range(len(data))), default=1)
        return batch_width(batch_size, self.batch_size or batch_size, self._largest)

    def _train(self, group: list[Pending], out: list[Done | Exception | None]) -> None:
        runtime = self.runtime
        started = time.perf_counter()
        try:
            trained = train_group(runtime.model, runtime.loss_fn, [p.job for p in group], [p.step for p in group],
                                  self.width(group[0].job.instruction.work.batch_size))
        except Exception as exc:
            for p in group:
                out[p.index] = exc
            return
        elapsed = time.perf_counter() - started
        total_steps = sum(r.steps for r in trained.results) or 1
        for p, result, delta in zip(group, trained.results, trained.deltas):
            try:
                update = runtime.algorithm.finish(p.job, result, delta)  # type: ignore[attr-defined]
                share = elapsed * result.steps / total_steps  # the group's compute time, by each client's steps
                out[p.index] = runtime.trained(p.job, p.instruction, update, share)
            except Exception as exc:
                out[p.index] = exc

    def _tell(self, line: str) -> None:
        key = line.split(":", 1)[1] if line.startswith("client ") else line
        if key not in self._told:
            self._told.add(key)
            log.info("simulation.cohort: %s", line)


def batch_width(batch_size: int, base: int, largest: int) -> int:
    """The rows the batches of a client of ``batch_size`` are padded to, a function of its batch
    size alone, not of the group it trains in (whose largest batch would make a client's padded
    products, and so the bits of its update, depend on its group or worker process): ``base`` (the
    run's batch size), or the nearest of it doubled or halved (rounded up) again and again that holds
    ``batch_size`` (batch sizes that differ from client to client, an adaptive controller's, fall
    into a few widths, a batch of that size padded less than twice over), never more than ``largest``
    (the most training rows a client of the run has), rounded up to a multiple of 8: MKL's batched
    product sums a product of some other widths (5, 7, 10, ...) by the matrix's place in the batch."""
    width = base
    while width < batch_size:
        width *= 2
    while width > 1 and -(-width // 2) >= batch_size:
        width = -(-width // 2)
    return -(-min(width, largest) // 8) * 8


_BYTES: weakref.WeakKeyDictionary[nn.Module, dict[tuple, int]] = weakref.WeakKeyDictionary()


def _group_bytes(model: nn.Module, example: torch.Tensor, batch: int) -> int:
    """:func:`group_bytes`, measured once per model, shape of an input row and batch size."""
    known = _BYTES.setdefault(model, {})
    key = (tuple(example.shape), example.dtype, batch)
    if key not in known:
        known[key] = group_bytes(model, example, batch)
    return known[key]


def groups(
    pending: list[Pending], limit: int | None, budget: int, runtime: ClientRuntime, width: Callable[[int], int]
) -> list[list[Pending]]:
    """``pending`` in cohorts: clients with the same settings, batch width (``width`` of their batch
    size) and kind of step together, the most steps first (so that the clients of a group stop at
    nearly the same step), each group at most ``limit`` clients and ``budget`` bytes."""
    by_kind: dict[tuple, list[Pending]] = {}
    for p in pending:
        kind = (p.job.settings, width(p.job.instruction.work.batch_size), p.step.penalty, p.step.correction is not None)
        by_kind.setdefault(kind, []).append(p)
    out: list[list[Pending]] = []
    for (_, rows, *_), members in by_kind.items():
        members.sort(key=lambda p: -steps_of(p.job))
        size = group_size(limit, budget, _group_bytes(runtime.model, members[0].job.x_train[0], rows))
        out.extend(members[i : i + size] for i in range(0, len(members), size))
    return out
