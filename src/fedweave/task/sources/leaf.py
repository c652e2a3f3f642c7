"""LEAF's JSON (Caldas et al., 2018): ``users``, ``num_samples`` and ``user_data`` (each user's
``x`` and ``y``), one file or a folder of such files read in name order.

Columns: ``x``, ``y`` and ``user`` (the user each row belongs to, for ``task.partition.scheme:
natural``).
"""

from __future__ import annotations

import json
import os

import numpy as np

from fedweave.errors import TaskError
from fedweave.task.sources.table import Columns, column_array


def read(path: str) -> Columns:
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(path, f) for f in os.listdir(path) if f.endswith(".json")
    )
    xs: list[object] = []
    ys: list[object] = []
    users: list[str] = []
    for file in files:
        with open(file) as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as exc:
                raise TaskError(f"{file}: not JSON: {exc.msg}") from exc
        if not isinstance(data, dict) or not {"users", "num_samples", "user_data"} <= data.keys():
            raise TaskError(f"{file}: not LEAF JSON (an object with users, num_samples and user_data)")
        if len(data["users"]) != len(data["num_samples"]):
            raise TaskError(f"{file}: {len(data['users'])} users but {len(data['num_samples'])} num_samples")
        for user, count in zip(data["users"], data["num_samples"]):
            rows = data["user_data"].get(user) if isinstance(data["user_data"], dict) else None
            if not isinstance(rows, dict) or not isinstance(rows.get("x"), list) or not isinstance(rows.get("y"), list):
                raise TaskError(f"{file}: user_data has no x and y lists for user {user!r}")
            if not len(rows["x"]) == len(rows["y"]) == count:
                raise TaskError(f"{file}: user {user!r} has {len(rows['x'])} x, {len(rows['y'])} y, num_samples {count}")
            xs.extend(rows["x"])
            ys.extend(rows["y"])
            users.extend([str(user)] * count)
    if not users:
        raise TaskError(f"{path}: no LEAF samples")
    return {"x": column_array(xs, path, "x"), "y": column_array(ys, path, "y"), "user": np.asarray(users)}
