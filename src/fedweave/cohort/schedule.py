"""The batches of a cohort: each client's draws exactly as the sequential loop makes them.

:class:`~fedweave.training.SGDLoop` draws, at the start of every pass over a client's ``n`` rows,
``torch.randperm(n, generator=job.generator)`` and cuts it into batches of ``b = min(batch_size,
n)``, the last one of a pass shorter when ``b`` does not divide ``n``. :func:`schedule` makes the
same draws from the same generator and lays them out for a group of clients: row numbers into the
group's concatenated training rows, one ``(steps, batch)`` table per client, valid rows first and
padding after them (``-1``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedweave.training import ClientJob


@dataclass(frozen=True)
class Schedule:
    """A group's batches: ``rows[k, t, :counts[k, t]]`` are the rows (into the group's concatenated
    data) of client k's batch at step t; ``counts[k, t]`` is 0 once client k has done its steps."""

    rows: torch.Tensor  # (K, T, B) int64, 0 where padded
    counts: torch.Tensor  # (K, T) int64
    steps: list[int]  # each client's own number of steps

    @property
    def length(self) -> int:
        return self.rows.shape[1]

    @property
    def batch(self) -> int:
        return self.rows.shape[2]


def client_draws(job: ClientJob, steps: int) -> torch.Tensor:
    """Client ``job``'s ``(steps, b)`` table of row numbers into its own training rows, ``-1`` where
    the last batch of a pass is shorter: what the sequential loop draws, in its order."""
    n = job.x_train.shape[0]
    b = min(job.instruction.work.batch_size, n)
    per_epoch = -(-n // b)
    passes = -(-steps // per_epoch)
    padded = torch.full((passes, per_epoch * b), -1, dtype=torch.int64)
    for e in range(passes):
        padded[e, :n] = torch.randperm(n, generator=job.generator)
    return padded.view(passes * per_epoch, b)[:steps]


def schedule(jobs: list[ClientJob], steps: list[int]) -> Schedule:
    """The batches of ``jobs`` (each with its own ``steps``), row numbers offset into the
    concatenation of their training rows in the order of ``jobs``."""
    tables = [client_draws(job, s) for job, s in zip(jobs, steps)]
    T, B = max(steps), max(t.shape[1] for t in tables)
    rows = torch.full((len(jobs), T, B), -1, dtype=torch.int64)
    offset = 0
    for k, (job, table) in enumerate(zip(jobs, tables)):
        s, b = table.shape
        rows[k, :s, :b] = torch.where(table >= 0, table + offset, table)
        offset += job.x_train.shape[0]
    counts = (rows >= 0).sum(dim=2)
    return Schedule(rows.clamp_min(0), counts, list(steps))
