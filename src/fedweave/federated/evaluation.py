"""The evaluation hooks a Flower user expects: aggregation of the clients' metrics by a function,
a server-side evaluation of the global parameters, and per-client evaluation records.

- ``eval.fit_metrics_aggregation`` / ``eval.evaluate_metrics_aggregation``: ``package.module:function``
  called ``f([(num_examples, metrics), ...])`` returning a dict of floats; the default of the
  evaluation metrics is :func:`weighted_mean` (the fit metrics: none beyond the train loss);
- ``eval.server_function``: ``package.module:function`` called ``f(params)`` with the global
  parameters (name -> tensor) whenever the server evaluates, returning a dict of floats (``server_<name>``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable

from fedweave.errors import ConfigError
from fedweave.registry import import_object
from fedweave.types import Params

MetricPairs = list[tuple[int, dict[str, float]]]
"""Each client's example count and metrics."""

Aggregation = Callable[[MetricPairs], dict[str, float]]
ServerFunction = Callable[[Params], dict[str, float]]


def weighted_mean(pairs: MetricPairs) -> dict[str, float]:
    """The mean of every metric that each client reports, weighted by the clients' example counts."""
    total = sum(n for n, _ in pairs)
    if not pairs or total <= 0:
        return {}
    names = set.intersection(*(set(m) for _, m in pairs))
    return {name: sum(m[name] * n for n, m in pairs) / total for name in sorted(names)}


def hook(spec: str | None, key: str) -> Callable[..., Any] | None:
    """The user function ``spec`` of config key ``key`` (none: None), imported when the run is built."""
    if spec is None:
        return None
    function = import_object(spec, key)
    if not callable(function):
        raise ConfigError(f"config key '{key}': {spec!r} is not callable")
    return function


def numbers(result: Any, what: str) -> dict[str, float]:
    """A user function's ``result`` as a dict of finite floats by name; anything else is a ValueError naming ``what``."""
    if not isinstance(result, dict) or not all(isinstance(k, str) for k in result):
        raise ValueError(f"{what} must return a dict of metric name -> number, got {type(result).__name__}")
    out = {}
    for name, value in result.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{what} returned {name}={value!r}, not a finite number")
        out[name] = float(value)
    return out


@dataclass(frozen=True)
class EvaluationHooks:
    """The user's evaluation hooks of a run (see the module's docstring); the defaults add nothing."""

    fit_aggregation: Aggregation | None = None
    evaluate_aggregation: Aggregation = weighted_mean
    server_function: ServerFunction | None = None
    per_client: bool = False

    def fit_metrics(self, pairs: MetricPairs) -> dict[str, float]:
        """The clients' training metrics aggregated by the user's function, as ``fit_<name>``."""
        if self.fit_aggregation is None or not pairs:
            return {}
        return {f"fit_{k}": v for k, v in numbers(self.fit_aggregation(pairs), "eval.fit_metrics_aggregation").items()}

    def server_metrics(self, params: Params) -> dict[str, float]:
        """The server function's metrics of ``params``, as ``server_<name>``."""
        if self.server_function is None:
            return {}
        return {f"server_{k}": v for k, v in numbers(self.server_function(params), "eval.server_function").items()}

    def federated_metrics(self, results: list[tuple[int, int, dict[str, float]]]) -> dict[str, Any]:
        """The clients' evaluation metrics (``(client id, examples, metrics)`` each) aggregated, as
        ``federated_<name>``, with ``federated_per_client`` (client id -> examples and metrics) when asked for."""
        pairs = [(n, metrics) for _, n, metrics in results]
        merged = numbers(self.evaluate_aggregation(pairs), "eval.evaluate_metrics_aggregation")
        record: dict[str, Any] = {f"federated_{k}": v for k, v in merged.items()}
        if self.per_client:
            record["federated_per_client"] = {
                str(cid): {"num_examples": n, **metrics} for cid, n, metrics in sorted(results, key=lambda r: r[0])
            }
        return record


def hooks_of(config: Any) -> EvaluationHooks:
    """The hooks that ``config.eval`` names, imported (a ConfigError naming the key when one cannot be)."""
    ev = config.eval
    return EvaluationHooks(
        fit_aggregation=hook(ev.fit_metrics_aggregation, "eval.fit_metrics_aggregation"),
        evaluate_aggregation=hook(ev.evaluate_metrics_aggregation, "eval.evaluate_metrics_aggregation") or weighted_mean,
        server_function=hook(ev.server_function, "eval.server_function"),
        per_client=ev.per_client,
    )
