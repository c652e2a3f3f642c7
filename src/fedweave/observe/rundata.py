"""What a run directory holds, read for a report or a status line: its resolved config,
its metrics records, its partition table. Works on a run still going on or interrupted:
a torn last line of ``metrics.jsonl`` (a writer caught mid-line) is left out."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedweave.config.yaml_safe import read_yaml

log = logging.getLogger(__name__)

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
PARTITION_FILE = "partition.json"


@dataclass
class RunData:
    """One run directory's files, parsed. ``config`` is the YAML as written (a plain mapping),
    so a report can be drawn without building anything of the run."""

    path: Path
    name: str
    config: dict[str, Any]
    config_text: str
    records: list[dict[str, Any]]
    partition: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def data_parallel(self) -> bool:
        return self.config.get("mode") == "data_parallel"

    @property
    def planned(self) -> int | None:
        """Rounds (federated) or steps (data-parallel, when the config fixes them) the run is to take."""
        if self.data_parallel:
            steps = (self.config.get("data_parallel") or {}).get("steps")
            return int(steps) if steps else None
        rounds = self.config.get("rounds")
        return int(rounds) if rounds else None

    @property
    def axis(self) -> str:
        """The record key that counts progress: ``round`` or ``step``."""
        return "step" if self.data_parallel else "round"


def read_records(path: str | Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The complete records of a metrics file and notes on lines left out (torn or not JSON)."""
    path = Path(path)
    if not path.is_file():
        return [], [f"{path.name} not written yet"]
    lines = path.read_text(errors="replace").split("\n")
    records, notes = [], []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, RecursionError):  # (a nesting deeper than the parser goes)
            last = number == len(lines)  # no newline after it: still being written
            notes.append(f"{path.name} line {number} {'is incomplete (being written)' if last else 'is not JSON'}; left out")
            continue
        if not isinstance(record, dict):
            continue
        axis = next((record[key] for key in ("round", "step") if key in record), None)
        if type(axis) is not int or axis < 0:
            notes.append(f"{path.name} line {number} has no round or step number; left out")
            continue
        records.append(record)
    return records, notes


def load_run(path: str | Path) -> RunData:
    """Read ``path``; a directory without ``config.yaml`` is not a run (``FileNotFoundError``)."""
    path = Path(path)
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"{str(path)!r} is not a run directory: it has no {CONFIG_FILE}")
    config = read_yaml(config_path)  # a ConfigError in one line for a file that is not a YAML mapping
    text = config_path.read_text()
    records, notes = read_records(path / METRICS_FILE)
    partition = None
    partition_path = path / PARTITION_FILE
    if partition_path.is_file():
        try:
            partition = json.loads(partition_path.read_text())
        except json.JSONDecodeError:
            notes.append(f"{PARTITION_FILE} is not JSON; left out")
    for note in notes:
        log.info("%s: %s", path, note)
    return RunData(path, path.resolve().name, config, text, records, partition, notes)
