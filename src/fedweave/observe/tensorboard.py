"""TensorBoard event files of a run (``observe.tensorboard``; extra ``tensorboard``): the
resolved config as text, each record's numbers as scalars at its round or step."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedweave.errors import ConfigError
from fedweave.observe.flatten import scalars


class TensorBoardLogger:
    def __init__(self, folder: Path, resolved_config: str):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ConfigError(
                "config key 'observe.tensorboard': needs TensorBoard; install it with pip install 'fedweave[tensorboard]'"
            ) from exc
        self.folder = folder
        self.writer = SummaryWriter(log_dir=str(folder))
        self.writer.add_text("config", "\n".join("    " + line for line in resolved_config.splitlines()))

    def record(self, step: int, record: Mapping[str, Any]) -> None:
        values = scalars(record)
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self, run_dir: Path, finished: bool) -> None:
        self.writer.close()
