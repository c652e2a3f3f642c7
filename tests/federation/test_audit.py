"""The audit log: a hash chain of whole JSON lines, kept by concurrent writers, broken by any edit."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedweave.federation.audit import GENESIS, AuditError, AuditLog, record_hash


def filled(path: Path, n: int = 4) -> AuditLog:
    log = AuditLog(path)
    for i in range(n):
        log.append("submitted", who="admin", job=f"j{i}", config_sha256="ab" * 32, bundle_sha256=None)
    return log


def test_append_chains_records(tmp_path: Path):
    log = AuditLog(tmp_path / "audit" / "log.jsonl")
    assert log.records() == [] and log.head() == GENESIS
    first = log.append("submitted", who="admin", job="j1")
    second = log.append("refused", site="lab-a", rule="policy.code", reason="no bundles")
    assert first["prev"] == GENESIS and second["prev"] == first["hash"]
    assert first["fields"] == {"who": "admin", "job": "j1"} and second["event"] == "refused"
    assert first["time"].endswith("+00:00")
    body = {k: v for k, v in first.items() if k != "hash"}
    expected = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert first["hash"] == record_hash(first) == expected
    assert log.records() == [first, second] and log.head() == second["hash"]
    log.verify()
    assert (tmp_path / "audit" / "log.jsonl").stat().st_mode & 0o777 == 0o600


def edit(path: Path, number: int, change) -> None:
    lines = path.read_text().splitlines(keepends=True)
    lines[number - 1] = change(lines[number - 1])
    path.write_text("".join(lines))


def test_an_altered_line_is_found_at_that_line(tmp_path: Path):
    log = filled(tmp_path / "log.jsonl")
    edit(log.path, 3, lambda line: line.replace('"who":"admin"', '"who":"mallory"'))
    with pytest.raises(AuditError, match="line 3 was altered") as error:
        log.verify()
    assert error.value.line == 3


def test_an_altered_line_with_its_hash_recomputed_is_found_at_the_next(tmp_path: Path):
    log = filled(tmp_path / "log.jsonl")

    def forge(line: str) -> str:
        record = json.loads(line)
        record["fields"]["who"] = "mallory"
        record["hash"] = record_hash(record)
        return json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n"

    edit(log.path, 2, forge)
    with pytest.raises(AuditError, match="line 3: its prev is not the hash of line 2") as error:
        log.verify()
    assert error.value.line == 3


def test_removed_inserted_and_cut_lines(tmp_path: Path):
    log = filled(tmp_path / "log.jsonl")
    lines = log.path.read_text().splitlines(keepends=True)
    log.path.write_text("".join(lines[:1] + lines[2:]))
    with pytest.raises(AuditError) as error:
        log.verify()
    assert error.value.line == 2
    log.path.write_text("".join(lines[1:]))
    with pytest.raises(AuditError, match="first line's prev") as error:
        log.verify()
    assert error.value.line == 1
    log.path.write_text("".join(lines)[:-5])
    with pytest.raises(AuditError, match="line 4 is not") as error:
        log.verify()
    log.path.write_text("".join(lines[:2]) + "not json\n" + "".join(lines[2:]))
    with pytest.raises(AuditError, match="line 3 is not JSON"):
        log.verify()


WRITER = """
import sys, time
from pathlib import Path
from fedweave.federation.audit import AuditLog
log = AuditLog(Path(sys.argv[1]))
go = Path(sys.argv[1] + ".go")
for _ in range(3000):  # both start together: at most 30 s
    if go.exists():
        break
    time.sleep(0.01)
for i in range(int(sys.argv[3])):
    log.append("started", writer=sys.argv[2], i=i, padding="x" * 3000)
"""


def test_two_processes_appending_keep_whole_lines_and_the_chain(tmp_path: Path):
    path = tmp_path / "log.jsonl"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    writers = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(path), name, "150"], env=env) for name in ("a", "b")
    ]
    Path(f"{path}.go").touch()
    for writer in writers:
        assert writer.wait(timeout=120) == 0
    log = AuditLog(path)
    log.verify()
    records = log.records()
    assert len(records) == 300
    for name in ("a", "b"):
        assert [r["fields"]["i"] for r in records if r["fields"]["writer"] == name] == list(range(150))


def test_nothing_is_appended_after_a_broken_last_line(tmp_path: Path):
    log = filled(tmp_path / "log.jsonl", 2)
    whole = log.path.read_bytes()
    log.path.write_bytes(whole[:-7])  # a writer cut off mid-line
    with pytest.raises(AuditError, match="line 2 is not a whole record; nothing appended") as error:
        log.append("started", job="j1")
    assert error.value.line == 2 and log.path.read_bytes() == whole[:-7]
    log.path.write_bytes(whole + b"[1, 2]\n")
    with pytest.raises(AuditError, match="line 3 is not a whole record"):
        log.head()
