"""Tests of fedweave.task.partition: coverage, seeding, skew, min_samples, errors and summaries."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedweave.errors import ConfigError
from fedweave.task import SCHEMES, format_summary, partition, split_local, summarize
from fedweave.task.partition import natural, size_partition

LABELS = np.repeat(np.arange(10), 100)  # 10 balanced classes, 1,000 samples
CLIENTS = {"linear": 8, "square": 6, "exponential": 5}
"""Clients of a size scheme whose smallest share of LABELS still holds 5 samples (other schemes: 20)."""


def rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def total_variation(parts: list[np.ndarray], labels: np.ndarray) -> float:
    """Mean over clients of the total-variation distance between client and global label distributions."""
    k = int(labels.max()) + 1
    global_dist = np.bincount(labels, minlength=k) / len(labels)
    distances = [0.5 * np.abs(np.bincount(labels[p], minlength=k) / len(p) - global_dist).sum() for p in parts]
    return float(np.mean(distances))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_sample_used_exactly_once(scheme: str) -> None:
    clients = CLIENTS.get(scheme, 20)
    parts = partition(LABELS, clients, scheme, rng(0), alpha=0.3, min_samples=5)
    assert len(parts) == clients
    assert all(p.dtype == np.int64 for p in parts)
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(len(LABELS)))
    assert min(len(p) for p in parts) >= 5


@pytest.mark.parametrize("scheme", SCHEMES)
def test_seeded(scheme: str) -> None:
    clients = CLIENTS.get(scheme, 10)
    a = partition(LABELS, clients, scheme, rng(4))
    b = partition(LABELS, clients, scheme, rng(4))
    c = partition(LABELS, clients, scheme, rng(5))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_iid_sizes_near_equal_and_labels_spread() -> None:
    parts = partition(LABELS, 7, "iid", rng(0))
    assert sorted(len(p) for p in parts) == [142] * 1 + [143] * 6  # 1000 = 6 * 143 + 142
    assert total_variation(parts, LABELS) < 0.15


def test_dirichlet_skew_grows_as_alpha_falls() -> None:
    def skew(alpha: float) -> tuple[float, float]:
        tv, classes = [], []
        for seed in range(4):
            parts = partition(LABELS, 10, "dirichlet", rng(seed), alpha=alpha)
            tv.append(total_variation(parts, LABELS))
            classes.append(summarize(parts, LABELS, 10)["classes_per_client_mean"])
        return float(np.mean(tv)), float(np.mean(classes))

    tv_low, classes_low = skew(0.1)
    tv_mid, _ = skew(1.0)
    tv_high, classes_high = skew(100.0)
    assert tv_low > tv_mid > tv_high
    assert tv_low > 0.5 and tv_high < 0.1
    assert classes_low < 6 and classes_high == 10


def test_dirichlet_impossible_request_is_a_config_error() -> None:
    labels = np.repeat(np.arange(10), 150)
    with pytest.raises(ConfigError) as err:
        partition(labels, 500, "dirichlet", rng(0), alpha=0.01, min_samples=2)
    assert str(err.value) == (
        "task.partition: dirichlet alpha=0.01 cannot give each of 500 clients at least 2 samples "
        "in 100 attempts; raise alpha or lower clients"
    )


def test_shards_limit_classes_per_client() -> None:
    # 50 clients x 2 shards = 100 shards of 10 samples: no shard straddles a class boundary
    parts = partition(LABELS, 50, "shards", rng(1), shards_per_client=2)
    assert all(len(p) == 20 for p in parts)
    assert all(len(np.unique(LABELS[p])) <= 2 for p in parts)
    one = partition(LABELS, 10, "shards", rng(1), shards_per_client=1)
    assert sorted(int(np.unique(LABELS[p])[0]) for p in one) == list(range(10))
    assert all(len(np.unique(LABELS[p])) == 1 for p in one)


def test_shards_errors_name_the_key() -> None:
    with pytest.raises(ConfigError, match="task.partition.shards_per_client: 10 clients x 200 shards"):
        partition(LABELS, 10, "shards", rng(0), shards_per_client=200)
    # 30 samples in 20 shards of 1 or 2: a client may get 2 samples, fewer than 3
    with pytest.raises(ConfigError, match="< min_samples 3"):
        partition(np.zeros(30, dtype=np.int64), 10, "shards", rng(0), shards_per_client=2, min_samples=3)


def test_quantity_skew_sizes_vary_more_at_small_alpha_labels_stay_iid() -> None:
    def size_spread(alpha: float) -> float:
        spreads = []
        for seed in range(4):
            sizes = np.array([len(p) for p in partition(LABELS, 10, "quantity", rng(seed), alpha=alpha)])
            spreads.append(sizes.std() / sizes.mean())
        return float(np.mean(spreads))

    assert size_spread(0.1) > 1.0 > 0.2 > size_spread(100.0)
    # labels within each client follow the global distribution (clients big enough to judge)
    parts = partition(LABELS, 4, "quantity", rng(0), alpha=100.0)
    assert total_variation(parts, LABELS) < 0.15


def test_quantity_honours_min_samples_at_extreme_alpha() -> None:
    parts = partition(LABELS, 100, "quantity", rng(0), alpha=0.01, min_samples=3)
    sizes = [len(p) for p in parts]
    assert min(sizes) >= 3 and sum(sizes) == 1000 and max(sizes) > 100


def test_too_few_samples_names_clients() -> None:
    expected = "^clients: 600 clients with at least 2 samples each need 1200 samples"
    with pytest.raises(ConfigError, match=expected):
        partition(LABELS, 600, "iid", rng(0))


def test_unknown_scheme_and_bad_values() -> None:
    expected = "unknown scheme 'natural'; valid: iid, dirichlet, shards, quantity, inner_dirichlet, pathological"
    with pytest.raises(ConfigError, match=expected):
        partition(LABELS, 10, "natural", rng(0))
    with pytest.raises(ConfigError, match="task.partition.alpha must be > 0"):
        partition(LABELS, 10, "dirichlet", rng(0), alpha=0.0)
    with pytest.raises(ConfigError, match="clients must be at least 1"):
        partition(LABELS, 0, "iid", rng(0))
    with pytest.raises(ConfigError, match="min_samples must be at least 1"):
        partition(LABELS, 10, "iid", rng(0), min_samples=0)


def test_split_local_sizes() -> None:
    indices = np.arange(100, 110)
    train, test = split_local(indices, 0.25, rng(0))
    assert (len(train), len(test)) == (7, 3)  # round(2.5) rounds half up to 3
    assert np.array_equal(np.sort(np.concatenate([train, test])), indices)
    assert [len(x) for x in split_local(np.arange(4), 0.1, rng(0))] == [3, 1]  # round(0.4) = 0, raised to 1
    assert [len(x) for x in split_local(np.arange(2), 0.9, rng(0))] == [1, 1]  # never all of them
    assert [len(x) for x in split_local(np.arange(1), 0.5, rng(0))] == [1, 0]
    assert [len(x) for x in split_local(np.arange(10), 0.0, rng(0))] == [10, 0]
    with pytest.raises(ConfigError, match="test_fraction"):
        split_local(indices, 1.0, rng(0))


def test_summarize_and_format() -> None:
    labels = np.array([0, 0, 1, 2, 2, 2, 1, 0])
    parts = [np.array([0, 1, 2]), np.array([3, 4]), np.array([5, 6, 7])]
    summary = summarize(parts, labels, num_classes=4)
    assert summary == {
        "clients": 3,
        "samples": 8,
        "counts": [3, 2, 3],
        "histograms": [[2, 1, 0, 0], [0, 0, 2, 0], [1, 1, 1, 0]],
        "min": 2,
        "max": 3,
        "mean": pytest.approx(8 / 3),
        "classes_per_client_mean": pytest.approx(2.0),
    }
    text = format_summary(summary, max_rows=2)
    lines = text.splitlines()
    assert len(lines) == 5
    assert lines[1].split() == ["0", "3", "2", "1", "0", "0"]
    assert lines[2].split() == ["1", "2", "0", "0", "2", "0"]
    assert lines[3] == "... 1 more"
    assert lines[4] == "3 clients, 8 samples; size min 2 / mean 2.7 / max 3; classes per client 2.00"
    assert "more" not in format_summary(summary)


def test_summarize_is_json_serialisable() -> None:
    parts = partition(LABELS, 5, "dirichlet", rng(0))
    summary = summarize(parts, LABELS, 10)
    assert json.loads(json.dumps(summary)) == summary
    assert summary["samples"] == 1000 and sum(map(sum, summary["histograms"])) == 1000


def test_summary_without_label_counts_holds_sizes_only() -> None:
    labels = np.array([0, 0, 1, 2, 2, 2, 1, 0])
    summary = summarize([np.array([0, 1, 2]), np.array([3, 4, 5, 6, 7])], labels, 3, label_counts=False)
    assert summary == {"clients": 2, "samples": 8, "counts": [3, 5], "min": 3, "max": 5, "mean": 4.0}
    lines = format_summary(summary).splitlines()
    assert lines == ["client  n", "     0  3", "     1  5", "2 clients, 8 samples; size min 3 / mean 4.0 / max 5"]


def test_size_partitions_by_hand() -> None:
    assert size_partition(10, 4, "linear") == [1, 2, 3, 4]  # weights 1, 2, 3, 4 of 10
    assert size_partition(30, 4, "square") == [1, 4, 9, 16]  # weights 1, 4, 9, 16 of 30
    # 20 * (1, 4, 9, 16) / 30 = 0.67, 2.67, 6, 10.67: floors 0, 2, 6, 10 (18); the two spare samples go
    # to the largest remainders, 2/3 each for clients 0, 1 and 3, the lower ids first
    assert size_partition(20, 4, "square") == [1, 3, 6, 10]
    assert size_partition(15, 4, "exponential") == [1, 2, 4, 8]  # weights 1, 2, 4, 8 of 15
    # 16 * (1, 2, 4, 8) / 15 = 1.07, 2.13, 4.27, 8.53: the one spare sample goes to client 3 (remainder 8/15)
    assert size_partition(16, 4, "exponential") == [1, 2, 4, 9]


@pytest.mark.parametrize(("scheme", "sizes"), [("linear", [1, 2, 3, 4]), ("square", [1, 3, 6, 10])])
def test_size_schemes_deal_those_sizes_of_a_permutation(scheme: str, sizes: list[int]) -> None:
    labels = np.zeros(sum(sizes), dtype=np.int64)
    parts = partition(labels, 4, scheme, rng(0), min_samples=1)
    assert [len(p) for p in parts] == sizes
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(len(labels)))
    with pytest.raises(ConfigError, match="give client 0 1 samples < min_samples 2"):
        partition(labels, 4, scheme, rng(0), min_samples=2)


def test_pathological_deals_classes_cyclically_and_splits_each_evenly() -> None:
    # 3 classes, 3 clients, k = 2: client 0 holds {0, 1}, client 1 {1, 2}, client 2 {2, 0}; each class
    # (4 samples) is halved between its two holders
    labels = np.repeat(np.arange(3), 4)
    parts = partition(labels, 3, "pathological", rng(0), classes_per_client=2, min_samples=1)
    assert [sorted(labels[p].tolist()) for p in parts] == [[0, 0, 1, 1], [1, 1, 2, 2], [0, 0, 2, 2]]
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(12))
    # 4 clients, k = 1 of 3 classes: class 0 is held by clients 0 and 3 (2 + 2), 1 by client 1, 2 by client 2
    one = partition(labels, 4, "pathological", rng(0), classes_per_client=1, min_samples=1)
    assert [sorted(labels[p].tolist()) for p in one] == [[0, 0], [1, 1, 1, 1], [2, 2, 2, 2], [0, 0]]


def test_pathological_refuses_classes_it_cannot_cover() -> None:
    labels = np.repeat(np.arange(10), 10)
    with pytest.raises(ConfigError, match="cover all 10 classes"):
        partition(labels, 3, "pathological", rng(0), classes_per_client=2)
    with pytest.raises(ConfigError, match="must lie in 1..10"):
        partition(labels, 10, "pathological", rng(0), classes_per_client=11)


def test_inner_dirichlet_gives_the_sizes_asked_and_skews_labels_with_alpha() -> None:
    labels = np.repeat(np.arange(2), 3)  # [0, 0, 0, 1, 1, 1]
    parts = partition(labels, 2, "inner_dirichlet", rng(0), sizes=[4, 2], min_samples=1)
    assert [len(p) for p in parts] == [4, 2]
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(6))
    even = partition(LABELS, 10, "inner_dirichlet", rng(0), alpha=0.1)
    assert [len(p) for p in even] == [100] * 10  # no sizes: as even as possible
    skewed = np.mean([total_variation(partition(LABELS, 10, "inner_dirichlet", rng(s), alpha=0.1), LABELS) for s in range(3)])
    spread = np.mean([total_variation(partition(LABELS, 10, "inner_dirichlet", rng(s), alpha=100.0), LABELS) for s in range(3)])
    assert skewed > 0.4 > 0.15 > spread
    partial = partition(LABELS, 2, "inner_dirichlet", rng(0), sizes=[10, 5])  # 15 of 1,000 samples, once each
    assert [len(p) for p in partial] == [10, 5] and len(np.unique(np.concatenate(partial))) == 15
    with pytest.raises(ConfigError, match="task.partition.sizes"):
        partition(LABELS, 2, "inner_dirichlet", rng(0), sizes=[600, 600])


def test_natural_one_client_per_value_in_order_of_first_appearance() -> None:
    groups = np.array(["b", "a", "b", "c", "a", "b"])
    parts = natural(groups, 3, min_samples=1)
    assert [p.tolist() for p in parts] == [[0, 2, 5], [1, 4], [3]]
    with pytest.raises(ConfigError, match="^clients: 4, but task.partition.scheme natural finds 3 distinct .*set clients: 3$"):
        natural(groups, 4, min_samples=1)
    with pytest.raises(ConfigError, match="client 'c' .* has fewer than 2 samples"):
        natural(groups, 3, min_samples=2)
