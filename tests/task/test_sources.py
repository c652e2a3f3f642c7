"""Tests of fedweave.task.sources: each format's reader, format inference, column selection, labels."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fedweave.errors import TaskError
from fedweave.task.sources import Samples, class_ids, infer_format, read_columns, select

from .conftest import write_leaf


def test_csv_columns_numbers_and_strings(tmp_path: Path) -> None:
    path = tmp_path / "a.csv"
    path.write_text("f0,f1,label,site\n1,2.5,0,x\n-3,4,1,y\n")
    columns = read_columns(str(path), "csv", "k")
    assert columns["f1"].tolist() == [2.5, 4.0] and columns["site"].tolist() == ["x", "y"]
    samples = select(columns, str(path), "label", None, "site")  # the partition column is no feature
    assert samples.x.dtype == np.float32 and samples.x.tolist() == [[1.0, 2.5], [-3.0, 4.0]]
    assert samples.labels.tolist() == [0.0, 1.0] and samples.groups.tolist() == ["x", "y"]
    assert select(columns, str(path), "label", ["f1"], None).x.tolist() == [2.5, 4.0]


def test_csv_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("f0,label\n1,0\n2\n")
    with pytest.raises(TaskError, match=f"^{path}: line 3 has 1 fields, the header 2$"):
        read_columns(str(path), "csv", "k")
    path.write_text("f0,label\nabc,0\n")
    with pytest.raises(TaskError, match=f"^task.dataset_options.features: column 'f0' of {path} is not numeric$"):
        select(read_columns(str(path), "csv", "k"), str(path), "label", None, None)
    with pytest.raises(TaskError, match=f"^task.dataset_options.label: {path} has no column 'y'; it has f0, label$"):
        select(read_columns(str(path), "csv", "k"), str(path), "y", None, None)
    with pytest.raises(TaskError, match=f"^task.dataset_options.path: no such file or folder: {tmp_path}/none.csv$"):
        read_columns(str(tmp_path / "none.csv"), "csv", "task.dataset_options.path")


def test_jsonl_fields_keep_their_shape(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_text("\n".join(json.dumps({"x": [[i, i + 1], [i + 2, i + 3]], "y": i % 2}) for i in range(3)) + "\n")
    samples = select(read_columns(str(path), "jsonl", "k"), str(path), "y", None, None)
    assert samples.x.shape == (3, 2, 2) and samples.x[2].tolist() == [[2, 3], [4, 5]]


def test_several_feature_columns_are_flattened_and_joined(tmp_path: Path) -> None:
    path = tmp_path / "a.npz"
    np.savez(path, img=np.arange(8).reshape(2, 2, 2), extra=np.array([10, 20]), y=np.array([1, 0]))
    samples = select(read_columns(str(path), "npz", "k"), str(path), "y", ["img", "extra"], None)
    assert samples.x.tolist() == [[0, 1, 2, 3, 10], [4, 5, 6, 7, 20]]


def test_npz_is_never_unpickled(tmp_path: Path) -> None:
    path = tmp_path / "a.npz"
    np.savez(path, x=np.array([{"a": 1}], dtype=object), y=np.array([0]))
    with pytest.raises(TaskError, match="never unpickled"):
        read_columns(str(path), "npz", "k")


def test_parquet(tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"f0": [1.0, 2.0], "v": [[1, 2], [3, 4]], "label": [1, 0]}), path)
    samples = select(read_columns(str(path), "parquet", "k"), str(path), "label", None, None)
    assert samples.x.tolist() == [[1, 1, 2], [2, 3, 4]]


def test_hf_dataset_and_dataset_dict(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    table = datasets.Dataset.from_dict({"x": [[1.0, 2.0], [3.0, 4.0]], "label": ["cat", "dog"]})
    table.save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict({"train": table, "test": table.select([1])}).save_to_disk(str(tmp_path / "two"))
    assert infer_format(str(tmp_path / "one"), "k") == infer_format(str(tmp_path / "two"), "k") == "hf"
    one = select(read_columns(str(tmp_path / "one"), "hf", "k"), "one", "label", None, None)
    assert one.x.tolist() == [[1, 2], [3, 4]] and class_ids(one, ["dog", "cat"]).tolist() == [1, 0]
    test = read_columns(str(tmp_path / "two"), "hf", "k", split="test")
    assert test["x"].tolist() == [[3.0, 4.0]]
    with pytest.raises(TaskError, match="has no split 'valid'; it has train, test"):
        read_columns(str(tmp_path / "two"), "hf", "k", split="valid")


def test_imagefolder_grey_images_by_class_folder(tmp_path: Path) -> None:
    image = pytest.importorskip("PIL.Image")
    for name, value in (("ants", 0), ("bees", 255)):
        (tmp_path / name).mkdir()
        for i in range(2):
            image.fromarray(np.full((3, 2), value, dtype=np.uint8)).save(tmp_path / name / f"{i}.png")
    assert infer_format(str(tmp_path), "k") == "imagefolder"
    columns = read_columns(str(tmp_path), "imagefolder", "k")
    assert columns["image"].shape == (4, 1, 3, 2) and columns["image"].max() == 1.0
    assert columns["label"].tolist() == ["ants", "ants", "bees", "bees"]
    image.fromarray(np.zeros((4, 4), dtype=np.uint8)).save(tmp_path / "bees" / "big.png")
    with pytest.raises(TaskError, match=r"big.png: an image of shape \(1, 4, 4\), the first is \(1, 3, 2\)"):
        read_columns(str(tmp_path), "imagefolder", "k")


def test_leaf_users_rows_and_checks(tmp_path: Path) -> None:
    path = write_leaf(tmp_path / "train.json", [2, 3], seed=0)
    assert infer_format(str(path), "k") == "leaf"
    columns = read_columns(str(path), "leaf", "k")
    assert columns["x"].shape == (5, 4) and columns["user"].tolist() == ["f_00000"] * 2 + ["f_00001"] * 3
    data = json.loads(path.read_text())
    data["num_samples"] = [2, 4]
    path.write_text(json.dumps(data))
    with pytest.raises(TaskError, match="user 'f_00001' has 3 x, 3 y, num_samples 4"):
        read_columns(str(path), "leaf", "k")


def test_labels_become_class_ids_never_rounded() -> None:
    def samples(labels: list[object]) -> Samples:
        return Samples("f.csv", np.zeros((len(labels), 1), np.float32), np.asarray(labels), None)

    assert class_ids(samples([2.0, 0.0]), None).tolist() == [2, 0]
    with pytest.raises(TaskError, match=r"^f.csv: label 1.5 is not a class id"):
        class_ids(samples([1.5]), None)
    with pytest.raises(TaskError, match=r"^f.csv: label 'owl' is not among task.dataset_options.classes"):
        class_ids(samples(["cat", "owl"]), ["cat", "dog"])


def test_format_inference_and_its_error(tmp_path: Path) -> None:
    suffixes = (".csv", ".parquet", ".npz", ".jsonl", ".json", ".txt")
    assert [infer_format(str(tmp_path / f"a{s}"), "k") for s in suffixes
            if (tmp_path / f"a{s}").touch() is None] == ["csv", "parquet", "npz", "jsonl", "leaf", "text"]
    (tmp_path / "a.tsv").touch()
    with pytest.raises(TaskError, match="cannot tell the format of .*a.tsv; give one of csv, parquet"):
        infer_format(str(tmp_path / "a.tsv"), "k")
