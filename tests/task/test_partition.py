"""Tests of fedweave.task.partition: coverage, seeding, skew, min_samples, errors and summaries."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedweave.errors import ConfigError
from fedweave.task import SCHEMES, format_summary, partition, split_local, summarize

LABELS = np.repeat(np.arange(10), 100)  # 10 balanced classes, 1,000 samples


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
    parts = partition(LABELS, 20, scheme, rng(0), alpha=0.3, min_samples=5)
    assert len(parts) == 20
    assert all(p.dtype == np.int64 for p in parts)
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(len(LABELS)))
    assert min(len(p) for p in parts) >= 5


@pytest.mark.parametrize("scheme", SCHEMES)
def test_seeded(scheme: str) -> None:
    a = partition(LABELS, 10, scheme, rng(4))
    b = partition(LABELS, 10, scheme, rng(4))
    c = partition(LABELS, 10, scheme, rng(5))
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
    expected = "unknown scheme 'pathological'; valid: iid, dirichlet, shards, quantity"
    with pytest.raises(ConfigError, match=expected):
        partition(LABELS, 10, "pathological", rng(0))
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
