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

import numpy as np
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


def schedule(jobs: list[ClientJob], steps: list[int], width: int | None = None) -> Schedule:
    """The batches of ``jobs`` (each with its own ``steps``), row numbers offset into the
    concatenation of their training rows in the order of ``jobs``, each batch padded to ``width``
    rows (None: the largest batch; never fewer).

    Each client's permutations are drawn as :func:`client_draws` draws them (one per pass, from its
    own generator, in order); laying them out is one vectorised pass over all of them: element
    ``j`` of client k's pass e lands in step ``e * per_epoch + j // b``, slot ``j % b``, kept while
    that step is below the client's steps."""
    sizes = [job.x_train.shape[0] for job in jobs]
    batches = [min(job.instruction.work.batch_size, n) for job, n in zip(jobs, sizes)]
    per_epoch = [-(-n // b) for n, b in zip(sizes, batches)]
    passes = [-(-s // e) for s, e in zip(steps, per_epoch)]
    K, T, B = len(jobs), max(steps), max(batches) if width is None else max(width, *batches)
    perms = [torch.randperm(n, generator=job.generator) for job, n, p in zip(jobs, sizes, passes) for _ in range(p)]
    values = torch.cat(perms).numpy() if perms else np.zeros(0, dtype=np.int64)
    # laid out with NumPy: a few thousand row numbers, where each operation's own cost is what counts
    size, b, epoch_steps, own_steps = (np.asarray(v, dtype=np.int64) for v in (sizes, batches, per_epoch, steps))
    pass_client = np.repeat(np.arange(K), passes)  # each pass's client
    pass_epoch = np.arange(len(pass_client)) - np.repeat(np.cumsum(passes) - passes, passes)  # its number
    length = size[pass_client]  # each pass's rows
    k = np.repeat(pass_client, length)  # each drawn row's client
    j = np.arange(len(k)) - np.repeat(np.cumsum(length) - length, length)  # its place in its pass
    bk = b[k]
    t = np.repeat(pass_epoch, length) * epoch_steps[k] + j // bk
    kept = np.flatnonzero(t < own_steps[k])
    k, t = k[kept], t[kept]
    rows = np.zeros(K * T * B, dtype=np.int64)
    rows[(k * T + t) * B + j[kept] % bk[kept]] = values[kept] + (np.cumsum(size) - size)[k]
    counts = np.bincount(k * T + t, minlength=K * T)
    return Schedule(torch.from_numpy(rows).view(K, T, B), torch.from_numpy(counts).view(K, T), list(steps))


