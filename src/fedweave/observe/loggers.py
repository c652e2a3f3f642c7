"""Where each metrics record goes besides ``metrics.jsonl``: the loggers of ``observe:``
(TensorBoard, MLflow), fed from the same place that appends the record to the file.

A logger gets the resolved config once, then each record at its round or step (most log
its numbers, :func:`~fedweave.observe.flatten.scalars`), then :meth:`RunLogger.close` at the
end of the run. A logger that fails mid-run (a tracking server gone) is dropped with a
warning: the run goes on, and ``metrics.jsonl`` keeps every record.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from fedweave.config import Config
from fedweave.observe.flatten import flat_params

log = logging.getLogger(__name__)


class RunLogger(Protocol):
    def record(self, step: int, record: Mapping[str, Any]) -> None: ...

    def close(self, run_dir: Path, finished: bool) -> None: ...


class Loggers:
    """The run's loggers; a record goes to each, keyed by its round (federated) or step."""

    def __init__(self, loggers: list[RunLogger], axis: str):
        self.loggers = loggers
        self.axis = axis

    def record(self, record: Mapping[str, Any]) -> None:
        for logger in list(self.loggers):
            try:
                logger.record(int(record[self.axis]), record)
            except Exception as exc:  # noqa: BLE001 - a logger's failure must not end the run
                log.warning("%s failed (%s); it gets no more records (metrics.jsonl has them all)",
                            type(logger).__name__, exc)
                self.loggers.remove(logger)

    def close(self, run_dir: Path, finished: bool = True) -> None:
        for logger in self.loggers:
            try:
                logger.close(run_dir, finished)
            except Exception as exc:  # noqa: BLE001 - the run's own files are written already
                log.warning("%s could not finish: %s", type(logger).__name__, exc)
        self.loggers = []


def open_loggers(config: Config, run_dir: Path, topology: object = None) -> Loggers:
    """The loggers ``config.observe`` asks for (none by default). ``topology``: the server's,
    whose transport, when it is a gRPC server, tells the endpoint's node counts."""
    from fedweave import config as config_mod

    obs = config.observe
    loggers: list[RunLogger] = []
    if obs.prometheus_port is not None:
        if config.mode == "data_parallel":
            log.warning("observe.prometheus_port: the endpoint serves federated servers; not started")
        else:
            from fedweave.observe.prometheus import NodeCounter, PrometheusLogger

            transport = getattr(topology, "transport", None)
            nodes = transport if isinstance(transport, NodeCounter) else None
            listening = getattr(transport, "address", None)  # a gRPC server's: the endpoint binds its host
            host = listening.rpartition(":")[0].strip("[]") if isinstance(listening, str) else "127.0.0.1"
            loggers.append(PrometheusLogger(obs.prometheus_port, config.rounds, nodes, host))
    if obs.tensorboard is not False or obs.mlflow.on:
        import yaml

        resolved = config_mod.to_yaml(config)
        if obs.tensorboard is not False:
            from fedweave.observe.tensorboard import TensorBoardLogger

            folder = Path(run_dir) / "tensorboard" if obs.tensorboard is True else Path(str(obs.tensorboard))
            loggers.append(TensorBoardLogger(folder, resolved))
        if obs.mlflow.on:
            from fedweave.observe.mlflow import MlflowLogger

            loggers.append(MlflowLogger(obs.mlflow, Path(run_dir), config.name, flat_params(yaml.safe_load(resolved))))
    return Loggers(loggers, "step" if config.mode == "data_parallel" else "round")
