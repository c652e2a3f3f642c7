"""An append-only, hash-chained audit log: every decision of a federation server or a site.

One JSON object a line, its keys sorted, written compactly::

    {"event":"refused","fields":{"job":"j3","reason":"...","rule":"policy.code","site":"lab-a"},
     "hash":"<sha256>","prev":"<sha256 of the line before>","time":"2026-12-02T15:04:05.123456+00:00"}

``hash`` is the sha256 of the line's canonical JSON without ``hash``; ``prev`` is the line before's
``hash`` (:data:`GENESIS` for the first). So altering a line is found at that line, and altering it
with its hash recomputed, removing or inserting lines, at the line after. Only the last line can be
rewritten unnoticed: compare :meth:`AuditLog.head` with a copy kept elsewhere (``fedweave job`` shows
it). Writers take an exclusive ``flock`` on the file, read the last line's hash, append with
``O_APPEND`` in one write and ``fsync``: two processes appending interleave whole lines and keep the chain.
Readers (:meth:`AuditLog.records`, :meth:`AuditLog.head`, :meth:`AuditLog.verify`) take a shared ``flock``,
so they never read a line a writer is still writing.

Events: submitted (who, job, config_sha256, bundle_sha256), assigned, accepted, refused (site, rule,
reason), started, finished, cancelled (who), failed.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeGuard

from fedweave.errors import FedweaveError

GENESIS = "0" * 64
"""The ``prev`` of a log's first line."""

EVENTS = ("submitted", "assigned", "accepted", "refused", "started", "finished", "cancelled", "failed")
"""The events the federation service writes (:meth:`AuditLog.append` takes any name)."""

TAIL_CHUNK = 4096


class AuditError(FedweaveError):
    """An audit log is not a whole chain; ``line`` is the first line (1-based) that breaks it."""

    def __init__(self, message: str, line: int):
        super().__init__(message)
        self.line = line


def _canonical(record: dict[str, Any]) -> str:
    return json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def record_hash(record: dict[str, Any]) -> str:
    """The sha256 of ``record``'s canonical JSON without its ``hash``."""
    body = {key: value for key, value in record.items() if key != "hash"}
    return hashlib.sha256(_canonical(body).encode()).hexdigest()


RECORD_KEYS = frozenset({"time", "event", "fields", "prev", "hash"})
"""The keys of every audit record."""


def _last_line(fd: int) -> tuple[bytes, bool] | None:
    """The last line of the file open as ``fd`` (without its newline) and whether a newline ends it, or
    None when the file is empty."""
    end = os.lseek(fd, 0, os.SEEK_END)
    if end == 0:
        return None
    whole = os.pread(fd, 1, end - 1) == b"\n"
    stop = end - 1 if whole else end
    start, position = 0, stop
    while position > 0:
        step = min(TAIL_CHUNK, position)
        position -= step
        cut = os.pread(fd, step, position).rfind(b"\n")
        if cut >= 0:
            start = position + cut + 1
            break
    return os.pread(fd, stop - start, start), whole


def _is_record(record: Any) -> TypeGuard[dict[str, Any]]:
    """Whether ``record`` is an audit record whose hash is the sha256 of its content."""
    if not isinstance(record, dict) or set(record) != RECORD_KEYS:
        return False
    try:
        return record["hash"] == record_hash(record)
    except (TypeError, ValueError):  # content canonical JSON cannot hold (NaN, keys of mixed types)
        return False


class AuditLog:
    """The audit log at ``path`` (created, with its folder, on the first :meth:`append`)."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def append(self, event: str, **fields: Any) -> dict[str, Any]:
        """Append one record of ``event`` with ``fields`` (JSON values) and return it."""
        if not event or not isinstance(event, str):
            raise ValueError(f"an audit event is a non-empty name, got {event!r}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            prev = self._last_hash(fd)
            record: dict[str, Any] = {
                "time": datetime.now(timezone.utc).isoformat(timespec="microseconds"),
                "event": event,
                "fields": fields,
                "prev": prev,
            }
            record["hash"] = record_hash(record)
            os.write(fd, (_canonical(record) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)  # releases the lock
        return record

    def _last_hash(self, fd: int) -> str:
        """The last record's hash; an AuditError when the last line is no whole record whose hash is its
        content's (a blank line, a writer cut off, a line forged without its hash): a log is never extended
        past a break (:meth:`verify` finds where it is)."""
        last = _last_line(fd)
        if last is None:
            return GENESIS
        line, whole = last
        try:
            record = json.loads(line) if whole else None
        except ValueError:
            record = None
        if not _is_record(record):
            lines = self.path.read_bytes().count(b"\n") + (0 if whole else 1)
            raise AuditError(f"{self.path}: line {lines} is not a whole record; nothing appended after it", lines)
        return record["hash"]

    def records(self) -> list[dict[str, Any]]:
        """Every record, in order (none when the log does not exist yet); an AuditError names a line that is
        not JSON (a writer cut off)."""
        if not self.path.exists():
            return []
        with open(self.path, "rb") as log:
            fcntl.flock(log.fileno(), fcntl.LOCK_SH)  # no writer's line half read
            data = log.read()
        found = []
        for number, line in enumerate(data.splitlines(), start=1):
            try:
                found.append(json.loads(line))
            except ValueError:
                where = f"{self.path}: line {number}"
                raise AuditError(f"{where} is not JSON (verify() finds where the chain breaks)", number) from None
        return found

    def head(self) -> str:
        """The last record's hash (:data:`GENESIS` for an empty log): keep a copy to detect a rewritten tail."""
        if not self.path.exists():
            return GENESIS
        fd = os.open(self.path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            return self._last_hash(fd)
        finally:
            os.close(fd)

    def verify(self) -> None:
        """Check the whole chain; an :class:`AuditError` names the first line that breaks it."""
        if not self.path.exists():
            return
        prev = GENESIS
        with open(self.path, "rb") as lines:
            fcntl.flock(lines.fileno(), fcntl.LOCK_SH)  # a writer's line is checked whole, never half written
            for number, raw in enumerate(lines, start=1):
                where = f"{self.path}: line {number}"
                if not raw.endswith(b"\n"):
                    raise AuditError(f"{where} is not a whole line (no newline at its end)", number)
                try:
                    record = json.loads(raw)
                except ValueError as exc:
                    raise AuditError(f"{where} is not JSON ({exc})", number) from None
                if not isinstance(record, dict) or set(record) != RECORD_KEYS:
                    raise AuditError(f"{where} is not an audit record (time, event, fields, prev, hash)", number)
                if record["hash"] != record_hash(record):
                    raise AuditError(f"{where} was altered: its hash is not the sha256 of its content", number)
                if record["prev"] != prev:
                    raise AuditError(
                        f"{where}: its prev is not the hash of line {number - 1}; a line before it was altered, "
                        "removed or inserted" if number > 1 else f"{where}: the first line's prev is not {GENESIS}",
                        number,
                    )
                prev = record["hash"]
