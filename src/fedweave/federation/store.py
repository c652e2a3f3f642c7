"""The federation server's job store: one folder per job, on disk, so a restarted server carries on.

``STORE/job-0001/`` holds ``job.json`` (the job's record, rewritten whole by temp file and rename),
``job.yaml`` (the config as submitted), ``bundle.tar`` (its code bundle, if any), ``run/`` (the run
folder of its server: metrics, checkpoints, the model), ``server.log``, and the job server's
``credentials/`` and ``code/``. ``STORE/audit.jsonl`` is the server's audit log.

A job's ``state`` is ``queued`` (offered to the sites once ``offered`` is set), ``running``,
``finished``, ``failed``, ``cancelled`` or ``refused``; ids grow with each submission
(``job-0001``, ...) and the queue is the queued jobs in id order, which a restart keeps.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from fedweave.federation.protocol import JOB_ID
from fedweave.files import atomic_write_bytes, atomic_write_text

STATES = ("queued", "running", "finished", "failed", "cancelled", "refused")
ENDED = ("finished", "failed", "cancelled", "refused")
RECORD, CONFIG, BUNDLE, RUN, LOG = "job.json", "job.yaml", "bundle.tar", "run", "server.log"
AUDIT = "audit.jsonl"


class JobStore:
    """The jobs in ``folder``; every method is safe from several threads of one process."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()

    def path(self, job: str) -> Path:
        return self.folder / job

    def ids(self) -> list[str]:
        """Every job's id, in submission order (FIFO)."""
        found = [p.name for p in self.folder.iterdir() if JOB_ID.fullmatch(p.name) and (p / RECORD).is_file()]
        return sorted(found, key=lambda name: int(name.split("-")[1]))

    def submit(self, config: dict[str, Any], bundle: bytes | None, bundle_sha256: str | None, by: str) -> dict[str, Any]:
        """Store a new queued job and return its record."""
        with self._lock:
            ids = [int(p.name.split("-")[1]) for p in self.folder.iterdir() if JOB_ID.fullmatch(p.name)]
            job = f"job-{max(ids, default=0) + 1:04d}"
            folder = self.path(job)
            folder.mkdir()
            text = yaml.safe_dump(config, sort_keys=False)
            atomic_write_text(text, folder / CONFIG)
            if bundle is not None:
                atomic_write_bytes(bundle, folder / BUNDLE)
            record: dict[str, Any] = {
                "id": job,
                "state": "queued",
                "submitted_by": by,
                "submitted_at": time.time(),
                "name": config.get("name") if isinstance(config.get("name"), str) else None,
                "rounds": config.get("rounds") if isinstance(config.get("rounds"), int) else None,
                "config_sha256": hashlib.sha256(text.encode()).hexdigest(),
                "bundle_sha256": bundle_sha256,
                "offered": None,
                "sites": {},
                "clients": {},
                "address": None,
                "cancel_requested": None,
                "reason": None,
                "run_dir": str(folder / RUN),
            }
            self._write(record)
            return record

    def get(self, job: str) -> dict[str, Any] | None:
        with self._lock:
            path = self.path(job) / RECORD
            if not JOB_ID.fullmatch(job) or not path.is_file():
                return None
            return dict(json.loads(path.read_text()))

    def update(self, job: str, **fields: Any) -> dict[str, Any]:
        """Set ``fields`` of ``job``'s record (one atomic rewrite) and return the record."""
        with self._lock:
            record = self.get(job)
            if record is None:
                raise KeyError(job)
            record.update(fields)
            self._write(record)
            return record

    def set_site(self, job: str, site: str, **fields: Any) -> dict[str, Any]:
        """Merge ``fields`` into site ``site``'s entry of ``job``'s record."""
        with self._lock:
            record = self.get(job)
            if record is None:
                raise KeyError(job)
            record["sites"][site] = {**record["sites"].get(site, {}), **fields}
            self._write(record)
            return record

    def config(self, job: str) -> dict[str, Any]:
        return dict(yaml.safe_load((self.path(job) / CONFIG).read_text()))

    def bundle(self, job: str) -> bytes | None:
        path = self.path(job) / BUNDLE
        return path.read_bytes() if path.is_file() else None

    def records(self) -> list[dict[str, Any]]:
        with self._lock:
            return [r for r in (self.get(job) for job in self.ids()) if r is not None]

    def _write(self, record: dict[str, Any]) -> None:
        atomic_write_text(json.dumps(record, indent=1, sort_keys=True) + "\n", self.path(record["id"]) / RECORD)
