"""Tests of fedweave.task.schema: a site's data checked against the federation's, declared schemas compared."""

from __future__ import annotations

import numpy as np
import pytest

from fedweave.errors import TaskError
from fedweave.task.schema import DataSchema, check_data

FEDERATION = DataSchema((4,), 3)


def test_fitting_data_passes() -> None:
    check_data("a.csv", np.zeros((5, 4), np.float32), np.array([0, 1, 2, 2, 0]), FEDERATION)


def test_a_different_feature_count_names_the_file() -> None:
    with pytest.raises(TaskError) as err:
        check_data("site/b.csv", np.zeros((5, 5), np.float32), np.zeros(5, np.int64), FEDERATION)
    assert str(err.value) == "site/b.csv: 5 features, the federation expects 4 features"
    with pytest.raises(TaskError, match=r"^img: samples of shape \(1, 8, 8\), the federation expects 4 features$"):
        check_data("img", np.zeros((2, 1, 8, 8), np.float32), np.zeros(2, np.int64), FEDERATION)


def test_a_label_outside_the_classes_names_the_file() -> None:
    with pytest.raises(TaskError) as err:
        check_data("c.csv", np.zeros((3, 4), np.float32), np.array([0, 5, 1]), FEDERATION)
    assert str(err.value) == "c.csv: label 5 is outside the model's 3 classes (0..2)"


def test_difference_gives_the_reason_or_none() -> None:
    assert FEDERATION.difference(DataSchema((4,), 3)) is None
    assert FEDERATION.difference(DataSchema((6,), 3)) == "6 features, the federation expects 4 features"
    assert FEDERATION.difference(DataSchema((4,), 10)) == "num_classes 10, the federation expects 3"


def test_a_declaration_round_trips_and_a_malformed_one_is_refused() -> None:
    declared = DataSchema((1, 28, 28), 10)
    assert DataSchema.from_dict(declared.to_dict()) == declared
    assert set(declared.to_dict()) == {"input_shape", "num_classes", "dtype", "label_kind"}  # no data, no counts
    for bad in ({**declared.to_dict(), "label_counts": [1]}, {**declared.to_dict(), "input_shape": [0]},
                {**declared.to_dict(), "num_classes": True}, {**declared.to_dict(), "dtype": "float64"}, []):
        with pytest.raises(ValueError):
            DataSchema.from_dict(bad)


def test_refusal_of_a_declared_schema_gives_the_reason() -> None:
    assert FEDERATION.refusal(FEDERATION.to_dict()) is None
    assert FEDERATION.refusal(DataSchema((4,), 4).to_dict()) == "its data has num_classes 4, the federation expects 3"
    assert FEDERATION.refusal(None) == "it declares no data schema, and this federation's sites read their own data"
    assert FEDERATION.refusal({"rows": 5}).startswith("its data schema is malformed: a data schema has input_shape")
