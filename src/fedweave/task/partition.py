"""Splitting a training set across clients: iid, label skew (dirichlet, shards) and quantity skew.

Pure functions; all randomness comes from the ``np.random.Generator`` passed in. Every
partition uses each sample exactly once and gives each client at least ``min_samples``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedweave.errors import ConfigError

SCHEMES = ("iid", "dirichlet", "shards", "quantity")

DIRICHLET_ATTEMPTS = 100
"""How many Dirichlet draws ``partition(scheme="dirichlet")`` tries before giving up."""


def partition(
    labels: np.ndarray,
    num_clients: int,
    scheme: str,
    rng: np.random.Generator,
    *,
    alpha: float = 0.5,
    shards_per_client: int = 2,
    min_samples: int = 2,
) -> list[np.ndarray]:
    """One int64 index array into ``labels`` per client; together they are a permutation of all indices.

    ``alpha`` is the Dirichlet concentration of ``dirichlet`` (label skew) and ``quantity``
    (size skew): smaller is more skewed. ``shards_per_client`` applies to ``shards``.
    """
    labels = np.asarray(labels)
    if scheme not in SCHEMES:
        raise ConfigError(f"task.partition.scheme: unknown scheme '{scheme}'; valid: {', '.join(SCHEMES)}")
    if num_clients < 1:
        raise ConfigError(f"clients must be at least 1, got {num_clients}")
    if min_samples < 1:
        raise ConfigError(f"task.partition.min_samples must be at least 1, got {min_samples}")
    integral = np.issubdtype(labels.dtype, np.integer)
    if labels.ndim != 1 or (labels.size and (not integral or labels.min() < 0)):
        raise ConfigError("task.partition: labels must be a 1-D array of non-negative integers")
    if len(labels) < num_clients * min_samples:
        raise ConfigError(
            f"clients: {num_clients} clients with at least {min_samples} samples each need "
            f"{num_clients * min_samples} samples, the training set has {len(labels)}; lower clients"
        )
    if scheme in ("dirichlet", "quantity") and not alpha > 0:
        raise ConfigError(f"task.partition.alpha must be > 0, got {alpha}")
    if scheme == "iid":
        return [part.astype(np.int64) for part in np.array_split(rng.permutation(len(labels)), num_clients)]
    if scheme == "dirichlet":
        return _dirichlet(labels, num_clients, rng, alpha, min_samples)
    if scheme == "shards":
        return _shards(labels, num_clients, rng, shards_per_client, min_samples)
    return _quantity(len(labels), num_clients, rng, alpha, min_samples)


def _dirichlet(
    labels: np.ndarray, num_clients: int, rng: np.random.Generator, alpha: float, min_samples: int
) -> list[np.ndarray]:
    """Label skew: each class is split over the clients by proportions drawn from Dir(alpha).

    As in NIID-Bench (Li et al., 2022) a client already holding its even share N / clients gets no
    more of the classes that follow, which keeps sizes from collapsing. The whole draw is repeated
    until every client holds ``min_samples``.
    """
    n = len(labels)
    by_class = [np.flatnonzero(labels == c) for c in np.unique(labels)]
    clients = np.arange(num_clients)
    for _ in range(DIRICHLET_ATTEMPTS):
        owner = np.empty(n, dtype=np.int64)
        sizes = np.zeros(num_clients, dtype=np.int64)
        for members in by_class:
            members = rng.permutation(members)
            proportions = rng.dirichlet(np.full(num_clients, alpha))
            open_share = proportions * (sizes < n / num_clients)
            if open_share.sum() > 0:
                proportions = open_share / open_share.sum()
            cuts = (np.cumsum(proportions) * len(members)).astype(np.int64)
            cuts[-1] = len(members)
            counts = np.diff(cuts, prepend=0)
            owner[members] = np.repeat(clients, counts)
            sizes += counts
        if sizes.min() >= min_samples:
            by_owner = np.split(np.argsort(owner, kind="stable"), np.cumsum(sizes)[:-1])
            return [rng.permutation(part).astype(np.int64) for part in by_owner]
    raise ConfigError(
        f"task.partition: dirichlet alpha={alpha} cannot give each of {num_clients} clients at least "
        f"{min_samples} samples in {DIRICHLET_ATTEMPTS} attempts; raise alpha or lower clients"
    )


def _shards(
    labels: np.ndarray, num_clients: int, rng: np.random.Generator, shards_per_client: int, min_samples: int
) -> list[np.ndarray]:
    """Pathological label skew (McMahan et al., 2017): sorted by label, cut into shards, dealt out."""
    if shards_per_client < 1:
        raise ConfigError(f"task.partition.shards_per_client must be at least 1, got {shards_per_client}")
    num_shards = num_clients * shards_per_client
    if num_shards > len(labels):
        raise ConfigError(
            f"task.partition.shards_per_client: {num_clients} clients x {shards_per_client} shards = "
            f"{num_shards} shards exceed the {len(labels)} samples; lower shards_per_client or clients"
        )
    shuffled = rng.permutation(len(labels))
    ordered = shuffled[np.argsort(labels[shuffled], kind="stable")]
    shards = np.array_split(ordered, num_shards)
    dealt = rng.permutation(num_shards).reshape(num_clients, shards_per_client)
    parts = [np.concatenate([shards[s] for s in row]).astype(np.int64) for row in dealt]
    smallest = min(len(p) for p in parts)
    if smallest < min_samples:
        raise ConfigError(
            f"task.partition.shards_per_client: with {num_shards} shards of {len(labels) // num_shards} "
            f"samples a client gets {smallest} < min_samples {min_samples}; raise shards_per_client"
        )
    return parts


def _quantity(
    n: int, num_clients: int, rng: np.random.Generator, alpha: float, min_samples: int
) -> list[np.ndarray]:
    """Quantity skew: iid labels, client sizes = min_samples + a Dir(alpha) share of the rest."""
    spare = n - num_clients * min_samples
    shares = rng.dirichlet(np.full(num_clients, alpha)) * spare
    extra = np.floor(shares).astype(np.int64)
    extra[np.argsort(-(shares - extra), kind="stable")[: spare - int(extra.sum())]] += 1
    sizes = min_samples + extra
    return [part.astype(np.int64) for part in np.split(rng.permutation(n), np.cumsum(sizes)[:-1])]


def split_local(
    indices: np.ndarray, test_fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """A client's own (train, test) split of its indices.

    The test part has round(test_fraction * n) samples (half rounds up), at least 1 when
    test_fraction > 0 and n >= 2, and never all of them; none when test_fraction == 0.
    """
    if not 0.0 <= test_fraction < 1.0:
        raise ConfigError(f"local test_fraction must lie in [0, 1), got {test_fraction}")
    n = len(indices)
    n_test = 0
    if test_fraction > 0 and n >= 2:
        n_test = min(max(1, int(np.floor(test_fraction * n + 0.5))), n - 1)
    shuffled = rng.permutation(np.asarray(indices, dtype=np.int64))
    return shuffled[n_test:], shuffled[:n_test]


def summarize(parts: list[np.ndarray], labels: np.ndarray, num_classes: int) -> dict[str, Any]:
    """JSON-serialisable sizes and per-class histograms of a partition."""
    labels = np.asarray(labels)
    histograms = [np.bincount(labels[p], minlength=num_classes) for p in parts]
    counts = [int(len(p)) for p in parts]
    return {
        "clients": len(parts),
        "samples": int(sum(counts)),
        "counts": counts,
        "histograms": [[int(v) for v in h] for h in histograms],
        "min": int(min(counts)),
        "max": int(max(counts)),
        "mean": float(np.mean(counts)),
        "classes_per_client_mean": float(np.mean([np.count_nonzero(h) for h in histograms])),
    }


def format_summary(summary: dict[str, Any], max_rows: int = 10) -> str:
    """A compact text table of ``summarize``'s result: one row per client, then totals."""
    counts = summary["counts"]
    width = max(len("n"), len(str(summary["max"])))
    id_width = max(len("client"), len(str(summary["clients"] - 1)))
    lines = [f"{'client':>{id_width}}  {'n':>{width}}  per-class counts"]
    for client, (count, histogram) in enumerate(zip(counts[:max_rows], summary["histograms"])):
        lines.append(f"{client:>{id_width}}  {count:>{width}}  {' '.join(str(v) for v in histogram)}")
    if summary["clients"] > max_rows:
        lines.append(f"... {summary['clients'] - max_rows} more")
    lines.append(
        f"{summary['clients']} clients, {summary['samples']} samples; size min {summary['min']} / "
        f"mean {summary['mean']:.1f} / max {summary['max']}; "
        f"classes per client {summary['classes_per_client_mean']:.2f}"
    )
    return "\n".join(lines)
