"""MLflow tracking of a run (``observe.mlflow``; extra ``mlflow``, i.e. ``mlflow-skinny``):
the resolved config as params, each record's numbers as metrics at its round or step, and
at the end the final model (``model.pt``, and ``model.he.pt`` where the server keeps it encrypted:
plugin he; a deployed server writes only that one) and the run's report as artifacts.

Without ``tracking_uri`` the run logs to a SQLite store, ``sqlite:///RUN_DIR/mlflow.db``, its
artifacts in ``RUN_DIR/mlartifacts``: what the installed MLflow reads back as it is
(``mlflow ui --backend-store-uri sqlite:///RUN_DIR/mlflow.db``). A run directory that already holds
the ``file:`` store of an earlier version (``RUN_DIR/mlruns``) keeps logging there (MLflow keeps
that store in maintenance mode and asks for ``MLFLOW_ALLOW_FILE_STORE``, which is set for a
``file:`` URI). The MLflow run's id is kept in ``RUN_DIR/mlflow-run-id``, so a resumed run logs
on to the same MLflow run.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedweave.config import MlflowConfig
from fedweave.errors import ConfigError
from fedweave.observe.flatten import scalars
from fedweave.rundir import MODEL_FILE, SEALED_MODEL_FILE

log = logging.getLogger(__name__)

RUN_ID_FILE = "mlflow-run-id"
STORE_FILE = "mlflow.db"
ARTIFACTS_DIR = "mlartifacts"
FILE_STORE_DIR = "mlruns"  # the default store before STORE_FILE
MAX_PARAM = 6000  # characters of a param value MLflow stores
BATCH = 100  # params or metrics per call


def default_uri(run_dir: Path) -> str:
    """The tracking URI of a run that names none: the SQLite store in ``run_dir`` (the ``file:``
    store where an earlier version made one)."""
    if (run_dir / FILE_STORE_DIR).is_dir():
        return (run_dir / FILE_STORE_DIR).resolve().as_uri()
    return f"sqlite:///{(run_dir / STORE_FILE).resolve()}"


class MlflowLogger:
    def __init__(self, settings: MlflowConfig, run_dir: Path, name: str, params: Mapping[str, str]):
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise ConfigError(
                "config key 'observe.mlflow': needs MLflow; install it with pip install 'fedweave[mlflow]'"
            ) from exc
        uri = settings.tracking_uri or default_uri(run_dir)
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        saved = run_dir / RUN_ID_FILE
        if saved.is_file():
            self.run_id = saved.read_text().strip()
            log.info("logging on to MLflow run %s", self.run_id)
            return
        experiment = settings.experiment or name
        found = self.client.get_experiment_by_name(experiment)
        artifacts = None if settings.tracking_uri else (run_dir / ARTIFACTS_DIR).resolve().as_uri()
        experiment_id = (found.experiment_id if found is not None
                         else self.client.create_experiment(experiment, artifact_location=artifacts))
        run = self.client.create_run(experiment_id, run_name=run_dir.name, tags={"fedweave.run_dir": str(run_dir)})
        self.run_id = run.info.run_id
        saved.write_text(self.run_id + "\n")
        from mlflow.entities import Param

        items = [Param(k, v[:MAX_PARAM]) for k, v in params.items()]
        for start in range(0, len(items), BATCH):
            self.client.log_batch(self.run_id, params=items[start : start + BATCH])
        log.info("logging to MLflow run %s (experiment %r, %s)", self.run_id, experiment, uri)

    def record(self, step: int, record: Mapping[str, Any]) -> None:
        values = scalars(record)
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in values.items()]
        for start in range(0, len(metrics), BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[start : start + BATCH])

    def close(self, run_dir: Path, finished: bool) -> None:
        """The final model (plain, encrypted, or both) and the report (written now) as artifacts; the run
        marked ended."""
        from fedweave.observe.report import REPORT_FILE, write_report

        for model in (run_dir / MODEL_FILE, run_dir / SEALED_MODEL_FILE):
            if model.is_file():
                self.client.log_artifact(self.run_id, str(model))
        self.client.log_artifact(self.run_id, str(write_report([run_dir])), artifact_path="report")  # figures inline
        log.info("MLflow run %s: model and %s logged", self.run_id, REPORT_FILE)
        self.client.set_terminated(self.run_id, "FINISHED" if finished else "FAILED")
