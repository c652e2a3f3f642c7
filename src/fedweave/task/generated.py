"""Clients whose data is generated when they need it: a million simulated clients
without a million-row array.

With ``task.dataset: synthetic`` and ``task.dataset_options.per_client: n``, client i's
n samples come from its own generator, ``numpy_rng(seed, "synthetic-client", i)``: first
its labels (uniform over the classes with ``task.partition.scheme: iid``; with
``dirichlet``, drawn from class proportions the client draws from Dir(alpha)), then
Gaussian features around the dataset's class means (:mod:`fedweave.task.datasets`), then
its local test split (:func:`~fedweave.task.partition.split_local`, as for any partition).
Nothing per client is held: a client's arrays exist while it works, and are the same in
every process, round and resumed run.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fedweave.errors import ConfigError
from fedweave.seeding import numpy_rng
from fedweave.task.datasets import synthetic_samples
from fedweave.task.partition import split_local, summarize

SCHEMES = ("iid", "dirichlet")
"""The partition schemes a client can draw on its own."""

SUMMARY_CLIENTS = 100
"""Clients generated to summarize the partition (``partition.json``, the printed table)."""


class GeneratedClients:
    """Each client's (train, local test) split, generated from the seed on demand."""

    def __init__(
        self,
        seed: int,
        num_clients: int,
        per_client: int,
        means: np.ndarray,
        *,
        scheme: str,
        alpha: float,
        local_test_fraction: float,
        min_samples: int,
    ):
        if scheme not in SCHEMES:
            raise ConfigError(
                f"task.partition.scheme: {scheme!r} needs the whole training set; with "
                f"task.dataset_options.per_client each client draws its own data: {' or '.join(SCHEMES)}"
            )
        if scheme == "dirichlet" and not alpha > 0:
            raise ConfigError(f"task.partition.alpha must be > 0, got {alpha}")
        if num_clients < 1:
            raise ConfigError(f"clients must be at least 1, got {num_clients}")
        self.seed = seed
        self.num_clients = num_clients
        self.per_client = per_client
        self.means = means
        self.scheme = scheme
        self.alpha = alpha
        self.local_test_fraction = local_test_fraction
        train = len(split_local(np.arange(per_client), local_test_fraction, np.random.default_rng(0))[0])
        if train < min_samples:
            raise ConfigError(
                f"task.dataset_options.per_client: {per_client} samples leave {train} for training after the "
                f"local test split, below task.partition.min_samples {min_samples}; raise per_client"
            )
        self._train_size = train

    def __len__(self) -> int:
        return self.num_clients

    def train_size(self, client_id: int) -> int:
        return self._train_size

    def split(self, client_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x_train, y_train, x_test, y_test`` of one client."""
        rng = self._generator(client_id)
        x, y = self._draw(rng)
        train, test = split_local(np.arange(self.per_client), self.local_test_fraction, rng)
        xt, yt = torch.from_numpy(x), torch.from_numpy(y)
        return xt[train], yt[train], xt[test], yt[test]

    def samples(self, client_id: int) -> tuple[np.ndarray, np.ndarray]:
        """All ``per_client`` samples of a client (before its local test split)."""
        return self._draw(self._generator(client_id))

    def _generator(self, client_id: int) -> np.random.Generator:
        """The client's own stream: its labels, then its features, then its local test split."""
        if not 0 <= client_id < self.num_clients:
            raise ValueError(f"client id {client_id} is outside 0..{self.num_clients - 1}")
        return numpy_rng(self.seed, "synthetic-client", client_id)

    def _draw(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        classes = len(self.means)
        if self.scheme == "iid":
            y = rng.integers(0, classes, size=self.per_client)
        else:
            y = rng.choice(classes, size=self.per_client, p=rng.dirichlet(np.full(classes, self.alpha)))
        return synthetic_samples(self.means, y, rng), y.astype(np.int64)

    def summary(self) -> dict[str, Any]:
        """:func:`~fedweave.task.partition.summarize`'s keys for the whole federation, with the
        counts and per-class histograms of the first ``SUMMARY_CLIENTS`` clients only
        (``listed``), from which ``classes_per_client_mean`` is estimated."""
        listed = min(self.num_clients, SUMMARY_CLIENTS)
        labels = [self.split(c)[1].numpy() for c in range(listed)]
        offsets = np.cumsum([0, *(len(y) for y in labels)])
        parts = [np.arange(offsets[i], offsets[i + 1]) for i in range(listed)]
        summary = summarize(parts, np.concatenate(labels), len(self.means))
        size = self._train_size
        return summary | {
            "clients": self.num_clients,
            "samples": self.num_clients * size,
            "min": size,
            "max": size,
            "mean": float(size),
            "listed": listed,
        }
