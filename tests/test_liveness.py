"""A node's liveness file (issue 27): touched while a node's loop runs, no longer once it ends, and
``fedweave probe`` failing on a missing or stale file."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from conftest import free_port, poll, small_config
from fedweave import cli
from fedweave.liveness import HEARTBEAT_ENV, check, heartbeat


def mtime(path: Path) -> int:
    return os.stat(path).st_mtime_ns


def test_the_file_is_touched_while_the_block_runs_and_not_after(tmp_path: Path) -> None:
    path = tmp_path / "heartbeat"
    with heartbeat(0.02, {}):
        pass
    assert not path.exists()  # without FEDWEAVE_HEARTBEAT: no file
    with heartbeat(0.02, {HEARTBEAT_ENV: str(path)}):
        first = mtime(path)  # written at once
        assert poll(lambda: mtime(path) != first, 10)
        path.unlink()  # a vanished file is written again
        assert poll(path.exists, 10)
    last = mtime(path)
    time.sleep(0.2)  # ten intervals
    assert mtime(path) == last


@pytest.mark.parametrize("age, code", [(None, 1), (120.0, 1), (0.0, 0)])
def test_fedweave_probe_fails_on_a_missing_or_stale_file_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], age: float | None, code: int
) -> None:
    path = tmp_path / "heartbeat"
    if age is not None:
        path.write_text("1\n")
        then = time.time() - age
        os.utime(path, (then, then))
    assert cli.main(["probe", "--heartbeat", str(path), "--max-age", "60"]) == code
    (line,) = capsys.readouterr().out.splitlines()
    expected = {None: f"not alive: {path}: missing (the node has not started its loop)",
                0.0: f"alive: {path}"}
    if age == 120.0:
        assert line.startswith(f"not alive: {path}: last touched 12") and line.endswith("s ago, over --max-age 60")
    else:
        assert line == expected[age]
    assert (check(path, 60) is None) == (code == 0)


def test_a_running_grpc_client_refreshes_its_file_until_the_server_ends_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from test_settled_state import FAST_GRPC

    from fedweave.nodes.client import run_client
    from fedweave.nodes.server import serve

    path = tmp_path / "heartbeat"
    monkeypatch.setenv(HEARTBEAT_ENV, str(path))
    port = free_port()
    config = small_config(*FAST_GRPC, f"grpc.listen=127.0.0.1:{port}", "clients=1", "rounds=1",
                          "grpc.heartbeat_interval=0.05", "grpc.connect_timeout=60")
    answered: list[int] = []
    client = threading.Thread(target=lambda: answered.append(run_client(config, 0, address=f"127.0.0.1:{port}")),
                              daemon=True)
    client.start()  # before the server: it retries its registration, its loop alive
    assert poll(path.exists, 60)
    first = mtime(path)
    assert poll(lambda: mtime(path) != first, 10) and client.is_alive()
    serve(config, tmp_path / "run")
    client.join(timeout=30)
    assert not client.is_alive() and answered == [1]
    last = mtime(path)
    time.sleep(0.5)  # ten intervals
    assert mtime(path) == last
    assert check(path, 0.25) is not None
