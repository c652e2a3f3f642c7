"""Splitting a training set across clients: iid, label skew (dirichlet, inner_dirichlet, shards,
pathological), size skew (quantity, linear, square, exponential), and the natural split of a
federated dataset (one client per user).

Pure functions; all randomness comes from the ``np.random.Generator`` passed in. Every
partition uses each sample exactly once (inner_dirichlet with ``sizes`` summing below the
dataset's: at most once) and gives each client at least ``min_samples``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedweave.errors import ConfigError

SCHEMES = ("iid", "dirichlet", "shards", "quantity", "inner_dirichlet", "pathological", "linear", "square", "exponential")
"""The schemes :func:`partition` draws; ``natural`` (:func:`natural`) and ``from_file``
(:mod:`fedweave.task.assignment`) take the split from the data."""

SIZE_WEIGHTS = {
    "linear": lambda i: i + 1,
    "square": lambda i: (i + 1) ** 2,
    "exponential": lambda i: 2**i,
}
"""Client i's share of the samples in a size partition, relative to the others'."""

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
    classes_per_client: int = 2,
    sizes: list[int] | None = None,
    min_samples: int = 2,
) -> list[np.ndarray]:
    """One int64 index array into ``labels`` per client; together they are a permutation of all indices.

    ``alpha`` is the Dirichlet concentration of ``dirichlet``, ``inner_dirichlet`` (label skew)
    and ``quantity`` (size skew): smaller is more skewed. ``shards_per_client`` applies to
    ``shards``, ``classes_per_client`` to ``pathological``, ``sizes`` to ``inner_dirichlet``.
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
    if scheme in ("dirichlet", "quantity", "inner_dirichlet") and not alpha > 0:
        raise ConfigError(f"task.partition.alpha must be > 0, got {alpha}")
    if scheme == "iid":
        return [part.astype(np.int64) for part in np.array_split(rng.permutation(len(labels)), num_clients)]
    if scheme == "dirichlet":
        return _dirichlet(labels, num_clients, rng, alpha, min_samples)
    if scheme == "shards":
        return _shards(labels, num_clients, rng, shards_per_client, min_samples)
    if scheme == "inner_dirichlet":
        return _inner_dirichlet(labels, num_clients, rng, alpha, sizes, min_samples)
    if scheme == "pathological":
        return _pathological(labels, num_clients, rng, classes_per_client, min_samples)
    if scheme in SIZE_WEIGHTS:
        return _weighted_sizes(len(labels), num_clients, rng, scheme, min_samples)
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


def _inner_dirichlet(
    labels: np.ndarray,
    num_clients: int,
    rng: np.random.Generator,
    alpha: float,
    sizes: list[int] | None,
    min_samples: int,
) -> list[np.ndarray]:
    """Sizes first, then classes (Flower Datasets' InnerDirichletPartitioner): client c has ``sizes[c]``
    samples (default: as even as possible) and class proportions p_c ~ Dir(alpha). Its slots are filled
    one at a time, in a shuffled order of all slots, each with a class drawn from p_c over the classes
    not yet used up (from every class left once p_c has none left)."""
    n = len(labels)
    if sizes is None:
        sizes = [len(part) for part in np.array_split(np.arange(n), num_clients)]
    if len(sizes) != num_clients or sum(sizes) > n or min(sizes) < min_samples:
        raise ConfigError(
            f"task.partition.sizes: {sizes} must give each of the {num_clients} clients at least "
            f"{min_samples} samples and at most {n} in all"
        )
    classes = np.unique(labels)
    pools = [rng.permutation(np.flatnonzero(labels == c)) for c in classes]
    left = np.array([len(pool) for pool in pools])
    proportions = rng.dirichlet(np.full(len(classes), alpha), size=num_clients)
    taken: list[list[int]] = [[] for _ in range(num_clients)]
    for client in rng.permutation(np.repeat(np.arange(num_clients), sizes)):
        weights = proportions[client] * (left > 0)
        if not weights.sum() > 0:
            weights = (left > 0).astype(np.float64)
        cumulative = np.cumsum(weights)
        k = min(int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right")), len(classes) - 1)
        left[k] -= 1
        taken[client].append(int(pools[k][left[k]]))
    return [np.asarray(t, dtype=np.int64) for t in taken]


def _pathological(
    labels: np.ndarray, num_clients: int, rng: np.random.Generator, k: int, min_samples: int
) -> list[np.ndarray]:
    """k classes per client: client i holds the classes i, i+1, ..., i+k-1 (mod the number of classes,
    in sorted order), and each class's samples, shuffled, are split as evenly as possible between
    the clients holding it, in client order."""
    classes = np.unique(labels)
    if not 1 <= k <= len(classes) or num_clients + k - 1 < len(classes):
        raise ConfigError(
            f"task.partition.classes_per_client: {k} classes for each of {num_clients} clients must lie in "
            f"1..{len(classes)} and cover all {len(classes)} classes (clients + classes_per_client - 1 >= classes)"
        )
    held: list[list[int]] = [[] for _ in classes]
    for client in range(num_clients):
        for j in range(k):
            held[(client + j) % len(classes)].append(client)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c, holders in zip(classes, held):
        for client, share in zip(holders, np.array_split(rng.permutation(np.flatnonzero(labels == c)), len(holders))):
            parts[client].append(share)
    result = [np.concatenate(p).astype(np.int64) for p in parts]
    smallest = min(len(p) for p in result)
    if smallest < min_samples:
        raise ConfigError(
            f"task.partition.classes_per_client: a client gets {smallest} samples < min_samples {min_samples}; "
            "raise classes_per_client or lower clients"
        )
    return result


def size_partition(n: int, num_clients: int, scheme: str) -> list[int]:
    """Client sizes of a size partition: client i gets round(n * w_i / sum w) samples for the weights of
    ``SIZE_WEIGHTS[scheme]``, settled to ``n`` by largest remainder (ties: the lower id), exact in integers."""
    weights = [SIZE_WEIGHTS[scheme](i) for i in range(num_clients)]
    total = sum(weights)
    sizes = [n * w // total for w in weights]
    by_remainder = sorted(range(num_clients), key=lambda i: (-(n * weights[i] % total), i))
    for i in by_remainder[: n - sum(sizes)]:
        sizes[i] += 1
    return sizes


def _weighted_sizes(
    n: int, num_clients: int, rng: np.random.Generator, scheme: str, min_samples: int
) -> list[np.ndarray]:
    """Size skew by a fixed rule (linear, square, exponential): iid samples, sizes of :func:`size_partition`."""
    sizes = size_partition(n, num_clients, scheme)
    if min(sizes) < min_samples:
        raise ConfigError(
            f"task.partition.scheme: {scheme} sizes {sizes[:3]}... give client 0 {sizes[0]} samples < min_samples "
            f"{min_samples}; lower clients or min_samples"
        )
    return [part.astype(np.int64) for part in np.split(rng.permutation(n), np.cumsum(sizes)[:-1])]


def natural(groups: np.ndarray, num_clients: int, min_samples: int) -> list[np.ndarray]:
    """One client per distinct value of ``groups`` (a column, LEAF's users), in order of first
    appearance; ``num_clients`` must equal their count."""
    values, first, owner = np.unique(np.asarray(groups), return_index=True, return_inverse=True)
    if len(values) != num_clients:
        raise ConfigError(
            f"clients: {num_clients}, but task.partition.scheme natural finds {len(values)} distinct "
            f"task.partition.by values in the data; set clients: {len(values)}"
        )
    order = np.argsort(first, kind="stable")
    parts = [np.flatnonzero(owner == g).astype(np.int64) for g in order]
    small = next((values[g].item() for g, p in zip(order, parts) if len(p) < min_samples), None)
    if small is not None:
        raise ConfigError(
            f"task.partition.min_samples: client {small!r} (task.partition.by) has fewer than {min_samples} "
            "samples; lower min_samples"
        )
    return parts


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


def summarize(parts: list[np.ndarray], labels: np.ndarray, num_classes: int, *, label_counts: bool = True) -> dict[str, Any]:
    """JSON-serialisable sizes and, with ``label_counts``, per-class histograms of a partition."""
    labels = np.asarray(labels)
    counts = [int(len(p)) for p in parts]
    summary: dict[str, Any] = {
        "clients": len(parts),
        "samples": int(sum(counts)),
        "counts": counts,
        "min": int(min(counts)),
        "max": int(max(counts)),
        "mean": float(np.mean(counts)),
    }
    if label_counts:
        histograms = [np.bincount(labels[p], minlength=num_classes) for p in parts]
        summary["histograms"] = [[int(v) for v in h] for h in histograms]
        summary["classes_per_client_mean"] = float(np.mean([np.count_nonzero(h) for h in histograms]))
    return summary


def format_summary(summary: dict[str, Any], max_rows: int = 10) -> str:
    """A compact text table of ``summarize``'s result: one row per client, then totals (a server
    whose clients read their own data knows only how many there are)."""
    if "counts" not in summary:
        return f"{summary['clients']} clients, each reading its own data (their sizes stay at the sites)"
    counts = summary["counts"]
    histograms = summary.get("histograms")
    width = max(len("n"), len(str(summary["max"])))
    id_width = max(len("client"), len(str(summary["clients"] - 1)))
    lines = [f"{'client':>{id_width}}  {'n':>{width}}" + ("  per-class counts" if histograms is not None else "")]
    for client, count in enumerate(counts[:max_rows]):
        row = f"{client:>{id_width}}  {count:>{width}}"
        lines.append(row + (f"  {' '.join(str(v) for v in histograms[client])}" if histograms is not None else ""))
    if summary["clients"] > max_rows:
        lines.append(f"... {summary['clients'] - max_rows} more")
    totals = (
        f"{summary['clients']} clients, {summary['samples']} samples; size min {summary['min']} / "
        f"mean {summary['mean']:.1f} / max {summary['max']}"
    )
    if histograms is not None:
        totals += f"; classes per client {summary['classes_per_client_mean']:.2f}"
    lines.append(totals)
    return "\n".join(lines)
