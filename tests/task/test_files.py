"""Tests of fedweave.task.files and task.dataset: files end to end: a simulation from each client's own
file ({client}), LEAF's natural split, schema refusals, the central test set, partition.json's privacy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fedweave import config as config_mod
from fedweave import runner
from fedweave.build import build_server_task, build_site_task, build_task
from fedweave.errors import ConfigError, TaskError
from fedweave.task import format_summary, load_dataset
from fedweave.task.schema import DataSchema

from .conftest import blobs, write_csv, write_hf_sites, write_image_sites, write_leaf

SIZES = [30, 40, 50]  # the three clients' rows


def files_config(tmp_path: Path, options: dict[str, Any], *overrides: str) -> config_mod.Config:
    base = {
        "name": "files",
        "rounds": 3,
        "clients": 3,
        "output_dir": str(tmp_path / "runs"),
        "task": {"dataset": "files", "dataset_options": options, "model": "mlp", "model_options": {"hidden": [16]}},
        "local": {"epochs": 2, "batch_size": 8, "lr": 0.1},
        "checkpoint": {"every": 0},
    }
    return config_mod.from_dict(config_mod.apply_overrides(base, list(overrides)))


def run(config: config_mod.Config, run_dir: Path) -> list[dict[str, Any]]:
    return runner.execute(runner.prepare(config, run_dir))


def three_csvs(tmp_path: Path) -> dict[str, Any]:
    for client, size in enumerate(SIZES):
        write_csv(tmp_path / f"site_{client}.csv", *blobs(size, seed=client))
    write_csv(tmp_path / "test.csv", *blobs(60, seed=99))
    return {"path": str(tmp_path / "site_{client}.csv"), "label": "label", "test_path": str(tmp_path / "test.csv")}


def test_three_csv_sites_through_the_template_learn(tmp_path: Path) -> None:
    config = files_config(tmp_path, three_csvs(tmp_path))
    task = build_task(config)
    assert [len(task.clients.train_idx[c]) + len(task.clients.test_idx[c]) for c in range(3)] == SIZES
    x, y = blobs(SIZES[1], seed=1)  # client 1's rows are its file's, in order
    rows = np.sort(np.concatenate([task.clients.train_idx[1].numpy(), task.clients.test_idx[1].numpy()]))
    assert np.allclose(task.dataset.x_train[rows].numpy(), x) and task.dataset.y_train[rows].tolist() == y.tolist()
    records = run(config, tmp_path / "run")
    assert records[-1]["test_accuracy"] > 0.8  # 3 classes: chance is 1/3
    summary = json.loads((tmp_path / "run" / "partition.json").read_text())
    assert summary["counts"] == [len(task.clients.train_idx[c]) for c in range(3)] and "histograms" not in summary


def test_label_counts_reach_partition_json_only_when_the_sites_share_them(tmp_path: Path) -> None:
    config = files_config(tmp_path, three_csvs(tmp_path) | {"share_label_counts": True}, "rounds=1")
    run(config, tmp_path / "run")
    summary = json.loads((tmp_path / "run" / "partition.json").read_text())
    assert [sum(h) for h in summary["histograms"]] == summary["counts"]


def test_without_test_path_the_run_evaluates_on_the_clients(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    options = three_csvs(tmp_path)
    del options["test_path"]
    config = files_config(tmp_path, options, "rounds=2")
    assert len(build_task(config).dataset.y_test) == 0  # the server holds no test data
    with caplog.at_level("INFO", logger="fedweave.build"):
        records = run(config, tmp_path / "run")
    assert [r.message for r in caplog.records].count(
        "no central test set (task.dataset_options.test_path is not set): the server evaluates nothing; "
        "the run evaluates on the clients' local test splits only"
    ) == 1
    assert all(r["test_accuracy"] is None and 0.0 <= r["federated_accuracy"] <= 1.0 for r in records)


def test_hf_sites_learn(tmp_path: Path) -> None:
    options = write_hf_sites(tmp_path)
    config = files_config(tmp_path, options)
    assert build_task(config).dataset.num_classes == 3  # the names read, sorted: ant 0, bee 1, cow 2
    assert run(config, tmp_path / "run")[-1]["test_accuracy"] > 0.8


def test_imagefolder_sites_learn(tmp_path: Path) -> None:
    options = write_image_sites(tmp_path)
    config = files_config(tmp_path, options)
    assert build_task(config).dataset.input_shape == (1, 8, 8)
    assert run(config, tmp_path / "run")[-1]["test_accuracy"] > 0.75  # 2 classes: chance is 1/2


def test_leaf_natural_makes_one_client_per_user_and_learns(tmp_path: Path) -> None:
    sizes = [10 + (7 * u) % 23 for u in range(50)]  # 50 users of unequal sizes, 10..32 samples
    train = write_leaf(tmp_path / "train.json", sizes, seed=0)
    test = write_leaf(tmp_path / "test.json", [100], seed=1)
    options = {"path": str(train), "test_path": str(test)}
    config = files_config(tmp_path, options, "clients=50", "task.partition.scheme=natural", "sample_fraction=0.4",
                          "rounds=4")
    task = build_task(config)
    assert [len(task.clients.train_idx[c]) + len(task.clients.test_idx[c]) for c in range(50)] == sizes
    assert run(config, tmp_path / "run")[-1]["test_accuracy"] > 0.7
    with pytest.raises(ConfigError, match="^clients: 10, but task.partition.scheme natural finds 50 distinct"):
        build_task(files_config(tmp_path, options, "clients=10", "task.partition.scheme=natural"))


def test_natural_by_a_column_and_from_file(tmp_path: Path) -> None:
    path = tmp_path / "all.csv"
    path.write_text("f0,label,site\n0,0,b\n1,1,a\n2,0,b\n3,1,a\n4,0,c\n5,1,c\n")
    options = {"path": str(path), "label": "label"}
    natural = files_config(tmp_path, options, "task.partition={scheme: natural, by: site}", "task.local_test_fraction=0")
    assert [sorted(t.tolist()) for t in build_task(natural).clients.train_idx] == [[0, 2], [1, 3], [4, 5]]
    (tmp_path / "map.json").write_text(json.dumps({"0": [5, 4], "1": [0, 1], "2": [2, 3]}))
    mapped = files_config(tmp_path, options | {"features": ["f0"]}, f"task.partition={{scheme: from_file, file: {tmp_path / 'map.json'}}}",
                          "task.local_test_fraction=0")
    assert [sorted(t.tolist()) for t in build_task(mapped).clients.train_idx] == [[4, 5], [0, 1], [2, 3]]


def test_a_site_with_other_features_or_labels_is_refused(tmp_path: Path) -> None:
    options = three_csvs(tmp_path) | {"num_classes": 3}
    write_csv(tmp_path / "site_2.csv", *blobs(20, seed=2, features=5))
    with pytest.raises(TaskError) as err:
        build_task(files_config(tmp_path, options))
    assert str(err.value) == f"{tmp_path}/site_2.csv: 5 features, the federation expects 4 features"
    x, y = blobs(20, seed=2)
    write_csv(tmp_path / "site_2.csv", x, np.where(y == 2, 7, y))
    with pytest.raises(TaskError) as err:
        build_task(files_config(tmp_path, options))
    assert str(err.value) == f"{tmp_path}/site_2.csv: label 7 is outside the model's 3 classes (0..2)"


def test_partition_seed_fixes_the_split_while_seed_varies(tmp_path: Path) -> None:
    def split(*overrides: str) -> list[list[int]]:
        config = config_mod.load(None, ["clients=3", "task.partition=dirichlet", *overrides])
        return [t.tolist() for t in build_task(config).clients.train_idx]

    assert split("seed=1", "task.partition.seed=7") == split("seed=2", "task.partition.seed=7")
    assert split("seed=1") != split("seed=2")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["task.dataset_options={path: a.csv, label: y, colour: red}"],
         "unknown config key 'task.dataset_options.colour'"),
        (["task.dataset_options={path: a.csv, format: csv}"],
         "config key 'task.dataset_options.label': format csv needs the label column's name"),
        (["task.dataset_options={path: 'a_{client}.csv', label: y}", "task.partition=dirichlet"],
         "config key 'task.partition.scheme': each client reads its own file"),
        (["task.dataset_options={path: a.csv, label: y, test_path: 't_{client}.csv'}"],
         "config key 'task.dataset_options.test_path': the central test set is one file"),
        (["task.dataset_options={path: a.csv, label: y, classes: [a, b], num_classes: 3}"],
         "config key 'task.dataset_options.num_classes': 3, but classes names 2"),
        (["task.dataset=digits", "task.partition=natural"], "config key 'task.partition.scheme': natural needs"),
        (["task.partition={scheme: iid, by: site}"], "config key 'task.partition.by': only scheme natural uses it"),
        (["task.partition=from_file"], "config key 'task.partition.file': scheme from_file needs"),
        (["task.dataset_options={path: a.csv, format: csv, label: y}", "task.partition=natural"],
         "config key 'task.partition.by': scheme natural needs the column"),
    ],
)
def test_config_errors_at_load(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=f"^{message}"):
        config_mod.load(None, ["task.dataset=files", *overrides])


def test_data_parallel_has_no_files_dataset() -> None:
    with pytest.raises(TaskError, match="^dataset 'files': the sites' own files are read by each federated client"):
        load_dataset("files", seed=0)


def test_a_simulation_needs_the_clients_path(tmp_path: Path) -> None:
    with pytest.raises(TaskError, match="^task.dataset_options.path: a simulation reads the clients' data from path"):
        build_task(files_config(tmp_path, {"label": "label", "num_classes": 3}))


def test_a_deployed_site_reads_only_its_file_and_gets_the_simulations_split(tmp_path: Path) -> None:
    options = three_csvs(tmp_path) | {"num_classes": 3}
    simulated = build_task(files_config(tmp_path, options)).clients
    alone = files_config(tmp_path, options | {"path": None, "test_path": str(tmp_path / "absent.csv")})
    for client in range(3):
        site = build_site_task(alone, client, str(tmp_path / f"site_{client}.csv"))
        assert all(torch.equal(a, b) for a, b in zip(site.clients.split(client), simulated.split(client)))
        assert site.schema == DataSchema((4,), 3) and site.clients.train_size(client) == simulated.train_size(client)
    with pytest.raises(ValueError, match="holds the data of client 2 only"):
        site.clients.split(0)
    by_template = build_site_task(files_config(tmp_path, options), 1)  # no --data: its file of the template
    assert torch.equal(by_template.clients.split(1)[0], simulated.split(1)[0])
    with pytest.raises(TaskError, match="^task.dataset_options.num_classes: a deployed node reads only its own data"):
        build_site_task(files_config(tmp_path, three_csvs(tmp_path)), 0)


def test_a_server_of_sites_reads_the_test_set_only(tmp_path: Path) -> None:
    options = three_csvs(tmp_path) | {"num_classes": 3, "path": None}
    server = build_server_task(files_config(tmp_path, options))
    assert len(server.dataset.y_train) == 0 and len(server.dataset.y_test) == 60 and len(server.clients) == 0
    assert server.schema == DataSchema((4,), 3)
    assert format_summary(server.partition_summary) == "3 clients, each reading its own data (their sizes stay at the sites)"
    blind = build_server_task(files_config(tmp_path, {"num_classes": 3, "input_shape": [4], "label": "label"}))
    assert (len(blind.dataset.y_test), blind.dataset.input_shape) == (0, (4,))
    with pytest.raises(TaskError, match="^task.dataset_options.input_shape: a node that reads no data needs"):
        build_server_task(files_config(tmp_path, {"num_classes": 3, "label": "label"}))


def write_table(path: Path, header: list[str], rows: np.ndarray) -> None:
    path.write_text(",".join(header) + "\n" + "\n".join(",".join(f"{v:g}" for v in row) for row in rows) + "\n")


def test_regression_and_multilabel_targets_from_label_columns(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(60, 3))
    tags = (x[:, :2] > 0).astype(float)
    write_table(tmp_path / "t.csv", ["a", "b", "c", "y", "t0", "t1"], np.column_stack([x, x @ [1.0, -2.0, 0.5], tags]))
    path = str(tmp_path / "t.csv")
    scored = build_task(files_config(tmp_path, {"path": path, "label": "y", "features": ["a", "b", "c"]},
                                     "task.kind=regression"))
    assert scored.dataset.y_train.dtype == torch.float32 and scored.dataset.y_train.shape == (60,)
    assert scored.dataset.num_classes == 1 and scored.schema == DataSchema((3,), 1, label_kind="target")
    assert "label_counts" not in scored.partition_summary
    assert torch.allclose(scored.dataset.y_train, torch.from_numpy(x @ [1.0, -2.0, 0.5]).float(), atol=1e-4)
    tagged = build_task(files_config(tmp_path, {"path": path, "label": ["t0", "t1"], "features": ["a", "b", "c"]},
                                     "task.kind=multilabel"))
    assert torch.equal(tagged.dataset.y_train, torch.from_numpy(tags).float()) and tagged.dataset.num_classes == 2
    assert DataSchema.from_dict(tagged.schema.to_dict()) == tagged.schema
    with pytest.raises(TaskError, match=r"t.csv: label .* of a multilabel task is not 0 or 1$"):
        build_task(files_config(tmp_path, {"path": path, "label": ["y", "t1"], "features": ["a", "b", "c"]},
                                "task.kind=multilabel"))
