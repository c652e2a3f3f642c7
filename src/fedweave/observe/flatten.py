"""What a logger logs, flat: a metrics record's numbers (:func:`scalars`) and the resolved config's
settings as dotted keys (:func:`flat_params`). Shared by the loggers of :mod:`fedweave.observe.loggers`
(TensorBoard, MLflow)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of a record: its numeric fields, counts by reason (a round's ``rejected``)
    as ``<key>/<reason>``, and per-worker lists (aligned with ``workers``) as
    ``<key>/worker_<id>``. The round or step itself is the x axis, not a value."""
    out: dict[str, float] = {}
    workers = record.get("workers") or []
    for key, value in record.items():
        if key in ("round", "step") or isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            out[key] = float(value)
        elif isinstance(value, Mapping):
            out.update({f"{key}/{k}": float(v) for k, v in value.items()
                        if isinstance(v, (int, float)) and not isinstance(v, bool)})
        elif isinstance(value, list) and key != "workers" and len(value) == len(workers):
            out.update({f"{key}/worker_{w}": float(v) for w, v in zip(workers, value)
                        if isinstance(v, (int, float)) and not isinstance(v, bool)})
    return out


def flat_params(data: Any, prefix: str = "") -> dict[str, str]:
    """A nested config mapping as dotted keys and string values (MLflow params, TensorBoard text)."""
    if isinstance(data, Mapping) and data:
        out: dict[str, str] = {}
        for key, value in data.items():
            out.update(flat_params(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: str(data)}
