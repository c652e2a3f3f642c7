"""Separate processes over gRPC: a client killed mid-round, its restart, and Ctrl-C of the launcher.

Rounds are slowed by the ``slowlink`` test plugin (a sleep on the client's uplink while a
hold file exists), so a client can be killed while a round is in progress and a
restarted client has time to boot; removing the file lets the run finish quickly.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import free_port, poll

HERE = Path(__file__).resolve().parent


def write_config(path: Path, hold: Path, **top: Any) -> Path:
    config = {
        "name": "fault",
        "seed": 0,
        "clients": 3,
        "task": {
            "dataset": "synthetic",
            "dataset_options": {"samples": 300, "features": 8, "classes": 3},
            "model_options": {"hidden": [8]},
        },
        "local": {"batch_size": 16},
        "plugins": {"client_send": [{"name": "slowlink:SlowLink", "seconds": 0.4, "hold_file": str(hold)}]},
        "transport": "grpc",
        "grpc": {"heartbeat_interval": 0.2, "heartbeat_timeout": 2.0, "poll_timeout": 1.0, "backoff_max": 1.0},
        "checkpoint": {"every": 0},
        **top,
    }
    path.write_text(yaml.safe_dump(config))
    return path


def environment() -> dict[str, str]:
    """Children find the test plugin, and die with this test process."""
    path = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "FEDWEAVE_PARENT_PID": str(os.getpid())}


def start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "fedweave", *args],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=environment(),
            start_new_session=True,
        )


def records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    text = path.read_text()
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines() if line.strip()]


def wait_for(check: Callable[[], bool], timeout: float, what: str) -> None:
    if not poll(check, timeout, 0.1):
        pytest.fail(f"timed out after {timeout:g} s waiting for {what}")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/stat")
    return not (status.exists() and status.read_text().split(")")[-1].split()[0] == "Z")


def test_a_client_killed_mid_round_is_tolerated_and_rejoins(tmp_path: Path) -> None:
    hold = tmp_path / "hold"
    hold.touch()
    config = write_config(tmp_path / "fault.yaml", hold, rounds=60, clients=2, min_clients=1, round_timeout=30)
    run_dir = tmp_path / "run"
    address = f"127.0.0.1:{free_port()}"
    logs = {name: tmp_path / f"{name}.log" for name in ("server", "0", "1", "1-again")}
    procs = {"server": start(["server", str(config), "--run-dir", str(run_dir), "--listen", address], logs["server"])}
    for cid in ("0", "1"):
        procs[cid] = start(["client", str(config), "--id", cid, "--address", address], logs[cid])
    try:
        wait_for(lambda: len(records(run_dir)) >= 1, 120, "round 1")
        killed_in = records(run_dir)[-1]["round"] + 1  # the round now in progress
        procs["1"].send_signal(signal.SIGKILL)
        procs["1"].wait(5)
        wait_for(lambda: records(run_dir)[-1]["round"] >= killed_in, 60, f"round {killed_in} to end without client 1")
        procs["1-again"] = start(["client", str(config), "--id", "1", "--address", address], logs["1-again"])
        wait_for(
            lambda: any(r["round"] > killed_in and r["clients_completed"] == 2 for r in records(run_dir)),
            120,
            "the restarted client to answer a round",
        )
        hold.unlink()  # let the remaining rounds run fast
        assert procs["server"].wait(60) == 0
        for name in ("0", "1-again"):
            assert procs[name].wait(30) == 0, logs[name].read_text()[-2000:]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
    recs = records(run_dir)
    assert [r["round"] for r in recs] == list(range(1, 61))
    first = recs[killed_in - 1]  # the round client 1 was killed in went on without it
    assert first["clients_completed"] == 1 and not first.get("skipped") and first["train_loss"] is not None
    assert first["wall_time"] < 15, "the dead client must be given up after heartbeat_timeout, not round_timeout"
    server_log = logs["server"].read_text()
    assert "client 1 failed: lost: it has not sent a heartbeat" in server_log
    assert "client 1 registered again" in server_log
    assert (run_dir / "model.pt").is_file()


def test_ctrl_c_stops_every_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from fedweave import config as config_mod
    from fedweave import runner

    monkeypatch.syspath_prepend(str(HERE))  # the config names the test plugin
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    hold = tmp_path / "hold"
    hold.touch()  # rounds stay slow: the run is still going when it is interrupted
    config = config_mod.load(write_config(tmp_path / "run.yaml", hold, rounds=100, clients=2), ["launcher=process"])
    r = runner.prepare(config, tmp_path / "run")
    caplog.set_level(logging.INFO, logger="fedweave.launchers.process")

    def interrupt(record: dict[str, Any]) -> None:
        raise KeyboardInterrupt  # as Ctrl-C would, while the nodes are busy

    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        runner.execute(r, interrupt)
    assert time.monotonic() - started < 120
    pids = [int(m.split("(pid ")[1].rstrip(")")) for m in caplog.messages if m.startswith("started ")]
    assert len(pids) == 3, caplog.text[-2000:]
    assert not any(alive(pid) for pid in pids), "no node outlives the interrupted launcher"


def test_an_he_run_of_local_processes_ends_with_the_decrypted_model(tmp_path: Path) -> None:
    """`launcher: process` with plugin he: the server process keeps the model encrypted and writes
    model.he.pt only; the launcher, where every node runs and secret.ctx is, decrypts it into model.pt
    and the run's params, as a simulation's (within CKKS precision). It raised FileNotFoundError
    (model.pt) after the last round."""
    import torch

    from conftest import small_config
    from fedweave import rundir, runner
    from fedweave.cli import main

    assert main(["keys", "--out", str(tmp_path / "keys")]) == 0
    common = [f"plugins.client_send=[{{name: he, keys: {tmp_path / 'keys'}}}]", "eval.every=0",
              "eval.federated_every=1", "rounds=2", "clients=2", "checkpoint.every=0"]
    fast = ["grpc.heartbeat_interval=0.2", "grpc.heartbeat_timeout=3", "grpc.poll_timeout=0.5"]
    r = runner.prepare(small_config(*common, "launcher=process", "transport=grpc", *fast), tmp_path / "run")
    records = runner.execute(r)
    assert [rec["round"] for rec in records] == [1, 2] and records[-1]["federated_accuracy"] is not None
    simulated = runner.run_config(small_config(*common), tmp_path / "simulated").params
    on_disk = rundir.load_model(tmp_path / "run")
    for name, tensor in simulated.items():
        assert torch.allclose(r.params[name].to(tensor.dtype), tensor, atol=1e-5), name
        assert torch.equal(on_disk[name], r.params[name]), name
    assert (tmp_path / "run" / rundir.SEALED_MODEL_FILE).is_file()
