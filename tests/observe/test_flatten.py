"""Tests of fedweave.observe.flatten: a record's numbers and a config's settings, flat."""

from __future__ import annotations

from fedweave.observe.flatten import flat_params, scalars


def test_scalars_are_the_numbers_of_a_record() -> None:
    record = {"step": 4, "train_loss": 0.5, "adjustments": 2, "skipped": False, "test_accuracy": None,
              "workers": [0, 2], "batch": [8.0, 24.0], "idle_time": [None, 0.25], "clients": [{"id": 0}],
              "rejected": {"shape": 2, "dtype": 1}}
    assert scalars(record) == {"train_loss": 0.5, "adjustments": 2.0, "batch/worker_0": 8.0,
                               "batch/worker_2": 24.0, "idle_time/worker_2": 0.25,
                               "rejected/shape": 2.0, "rejected/dtype": 1.0}


def test_flat_params_are_dotted_strings() -> None:
    assert flat_params({"rounds": 3, "local": {"lr": 0.1, "steps": None}, "plugins": {"client_send": []}}) == {
        "rounds": "3", "local.lr": "0.1", "local.steps": "None", "plugins.client_send": "[]"}
