"""Clients that generate their data on demand: the same data in every instance and any
order, label skew by scheme, one-line config errors, a million clients built and run
in seconds, a resumed run equal to an uninterrupted one."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import assert_same_params, comparable, run_interrupted, run_to_end
from fedweave import config as config_mod
from fedweave import runner
from fedweave.errors import ConfigError
from fedweave.task.generated import SUMMARY_CLIENTS, GeneratedClients

MEANS = np.random.default_rng(0).normal(size=(4, 3))
GENERATED = ["task.dataset_options={samples: 400, features: 8, classes: 4, per_client: 20}"]


def clients(scheme: str = "iid", alpha: float = 0.5, n: int = 1000, per_client: int = 40) -> GeneratedClients:
    return GeneratedClients(
        7, n, per_client, MEANS, scheme=scheme, alpha=alpha, local_test_fraction=0.25, min_samples=2
    )


def test_a_clients_data_depends_on_the_seed_and_its_id_only() -> None:
    a, b = clients(), clients()
    later = [a.split(c) for c in (999, 3, 500)]
    first = [b.split(c) for c in (500, 3, 999)][::-1]  # another instance, another order
    for x, y in zip(later, first):
        assert all(torch.equal(u, v) for u, v in zip(x, y))
    x_train, y_train, x_test, y_test = later[1]
    assert x_train.shape == (30, 3) and x_test.shape == (10, 3) and x_train.dtype == torch.float32
    assert y_train.dtype == torch.int64 and a.train_size(3) == 30 and len(a) == 1000
    assert not torch.equal(a.split(4)[0], x_train)
    other_seed = GeneratedClients(8, 1000, 40, MEANS, scheme="iid", alpha=0.5, local_test_fraction=0.25, min_samples=2)
    assert not torch.equal(other_seed.split(3)[0], x_train)


def test_samples_lie_around_their_class_means_and_dirichlet_skews_labels() -> None:
    x, y = clients(per_client=4000).samples(0)
    for c in range(4):  # unit-variance noise: the mean of ~1,000 samples is within 0.15 of the class mean
        assert np.abs(x[y == c].mean(0) - MEANS[c]).max() < 0.15
    iid = [np.count_nonzero(np.bincount(clients().samples(c)[1], minlength=4)) for c in range(50)]
    skewed = [np.count_nonzero(np.bincount(clients("dirichlet", 0.05).samples(c)[1], minlength=4)) for c in range(50)]
    assert np.mean(iid) > 3.9 and np.mean(skewed) < 2.0


def test_schemes_that_need_the_whole_training_set_and_too_few_samples_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="task.partition.scheme: 'shards' needs the whole training set"):
        clients("shards")
    with pytest.raises(ConfigError, match="task.dataset_options.per_client: 2 samples leave 1 for training"):
        clients(per_client=2)
    with pytest.raises(ValueError, match="client id 1000 is outside 0..999"):
        clients().split(1000)


def test_summary_lists_a_few_clients_and_counts_them_all() -> None:
    summary = clients(n=1_000_000).summary()
    assert summary["clients"] == 1_000_000 and summary["samples"] == 30_000_000
    assert summary["min"] == summary["max"] == 30 and summary["listed"] == SUMMARY_CLIENTS
    assert len(summary["counts"]) == len(summary["histograms"]) == SUMMARY_CLIENTS
    assert summary["histograms"][3] == np.bincount(clients().split(3)[1].numpy(), minlength=4).tolist()


def test_a_million_clients_build_and_run_two_rounds_in_seconds(tmp_path: Path) -> None:
    started = time.process_time()  # CPU time: what another process's load does not add to
    config = config_mod.load(
        None,
        [
            "clients=1000000",
            "sample_fraction=0.00001",  # 10 clients per round
            "rounds=2",
            "task.dataset=synthetic",
            "task.dataset_options={samples: 200, features: 8, classes: 4, per_client: 20}",
            "task.model_options={hidden: [8]}",
            "task.partition.scheme=iid",
            "local.batch_size=10",
            "eval.federated_every=0",
        ],
    )
    r = runner.prepare(config, tmp_path)
    records = runner.execute(r)
    assert time.process_time() - started < 10
    assert [x["clients_completed"] for x in records] == [10, 10]
    assert records[-1]["test_accuracy"] > 0.5
    assert (tmp_path / "partition.json").stat().st_size < 50_000
    assert json.loads((tmp_path / "partition.json").read_text())["clients"] == 1_000_000
    assert "... 999990 more" in r.partition_summary
    assert len(r.parts.accepted.rounds) == 20  # bookkeeping only for the clients that trained


def test_a_resumed_generated_run_equals_an_uninterrupted_one(tmp_path: Path) -> None:
    params, records = run_to_end(tmp_path / "a", *GENERATED)
    resumed, resumed_records = run_interrupted(tmp_path / "b", 1, *GENERATED)
    assert_same_params(params, resumed)
    assert comparable(records) == comparable(resumed_records)
