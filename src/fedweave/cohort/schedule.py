"""The batches of a cohort: each client's draws exactly as the sequential loop makes them.

:class:`~fedweave.training.SGDLoop` draws, at the start of every pass over a client's ``n`` rows,
``torch.randperm(n, generator=job.generator)`` and cuts it into batches of ``b = min(batch_size,
n)``, the last one of a pass shorter when ``b`` does not divide ``n``. :func:`schedule` makes the
same draws from the same generator and lays them out for a group of clients: row numbers into the
group's concatenated training rows, one ``(steps, batch)`` table per client, valid rows first and
padding after them (``-1``).
"""

from __future__ import annotations

import itertools
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
    concatenation of their training rows in the order of ``jobs``.

    Each client's permutations are drawn as :func:`client_draws` draws them (one per pass, from its
    own generator, in order); laying them out is one vectorised pass over all of them: element
    ``j`` of client k's pass e lands in step ``e * per_epoch + j // b``, slot ``j % b``, kept while
    that step is below the client's steps."""
    sizes = [job.x_train.shape[0] for job in jobs]
    batches = [min(job.instruction.work.batch_size, n) for job, n in zip(jobs, sizes)]
    per_epoch = [-(-n // b) for n, b in zip(sizes, batches)]
    passes = [-(-s // e) for s, e in zip(steps, per_epoch)]
    K, T, B = len(jobs), max(steps), max(batches)
    perms = [torch.randperm(n, generator=job.generator) for job, n, p in zip(jobs, sizes, passes) for _ in range(p)]
    values = torch.cat(perms) if perms else torch.zeros(0, dtype=torch.int64)
    # per client: its rows, batch, batches per pass, steps, first pass and first row (one tensor, read by column)
    size, b, epoch_steps, own_steps, first, offset = torch.tensor(
        [sizes, batches, per_epoch, list(steps), _starts(passes), _starts(sizes)], dtype=torch.int64
    ).unbind(0)
    client = torch.repeat_interleave(torch.arange(K), torch.tensor(passes))  # each pass's client
    epoch = torch.arange(len(client)) - first[client]  # each pass's number within its client
    length = size[client]  # each pass's rows
    element = torch.repeat_interleave(torch.arange(len(client)), length)  # each drawn row's pass
    starts = torch.cumsum(length, 0) - length
    j = torch.arange(len(element)) - starts[element]  # its place in its pass
    k = client[element]
    bk = b[k]
    t = epoch[element] * epoch_steps[k] + torch.div(j, bk, rounding_mode="floor")
    kept = t < own_steps[k]
    at = ((k * T + t) * B + j % bk)[kept]
    rows = torch.zeros(K * T * B, dtype=torch.int64)
    rows[at] = (values + offset[k])[kept]
    counts = torch.bincount((k * T + t)[kept], minlength=K * T)
    return Schedule(rows.view(K, T, B), counts.view(K, T), list(steps))


def _starts(counts: list[int]) -> list[int]:
    """Where each of consecutive runs of ``counts`` starts: 0, c0, c0 + c1, ..."""
    return [0, *itertools.accumulate(counts)][: len(counts)]
