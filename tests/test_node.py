"""The nodes of a deployment: what `fedweave client` refuses before it connects."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import poll
from fedweave import config as config_mod
from fedweave.nodes.client import run_client
from fedweave.nodes.server import serve
from fedweave.errors import ConfigError

SRC = Path(__file__).parents[1] / "src"


def test_a_client_of_a_simulation_config_is_refused_at_once() -> None:
    config = config_mod.load(None, ["clients=2"])  # transport: inmemory
    with pytest.raises(ConfigError, match="config key 'transport': `fedweave client` connects to a server over gRPC"):
        run_client(config, 0)


def test_fedweave_client_on_a_simulation_config_prints_one_line_not_a_60_s_retry(tmp_path: Path) -> None:
    """Issue 14 item 13."""
    path = tmp_path / "sim.yaml"
    path.write_text("name: sim\nclients: 2\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    began = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from fedweave.cli import main; sys.exit(main())", "client", str(path), "--id", "0"],
        capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path,
    )
    assert time.monotonic() - began < 30
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "fedweave: error: config key 'transport': `fedweave client` connects to a server over gRPC, but this "
        "config's transport is 'inmemory' (its clients run inside `fedweave run`); set transport: grpc"
    ]


@pytest.mark.parametrize("strategy", ["fedavg", "scaffold"])
def test_a_server_killed_mid_round_and_started_again_ends_as_an_uninterrupted_run(
    strategy: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 13 item 3: kill -9 the server in round 2, start it with the same command; the clients
    retry, register again and drop what they trained in round 2, and the model is the same tensors."""
    from launchers.test_process import HERE, records, start, wait_for, write_config

    from conftest import free_port
    from fedweave import rundir, runner

    hold = tmp_path / "hold"
    hold.touch()
    slow = {"client_send": [{"name": "slowlink:SlowLink", "seconds": 1.0, "hold_file": str(hold)}]}
    config = write_config(
        tmp_path / "restart.yaml", hold, rounds=3, clients=2, strategy={"name": strategy}, checkpoint={"every": 1},
        plugins=slow, simulation={"cohort": "off"},  # the in-memory reference trains as the clients do, in sequence
    )
    run_dir = tmp_path / "run"
    server = ["server", str(config), "--run-dir", str(run_dir), "--listen", f"127.0.0.1:{free_port()}", "-q"]
    logs = {name: tmp_path / f"{name}.log" for name in ("server", "server-again", "0", "1")}
    procs = {"server": start(server, logs["server"])}
    address = server[server.index("--listen") + 1]
    for cid in ("0", "1"):
        procs[cid] = start(["client", str(config), "--id", cid, "--address", address], logs[cid])
    try:
        wait_for(lambda: len(records(run_dir)) >= 1, 120, "round 1")
        time.sleep(0.5)  # round 2 is under way: its clients trained and wait 1 s on the slow link
        procs["server"].send_signal(signal.SIGKILL)
        procs["server"].wait(5)
        assert [r["round"] for r in records(run_dir)] == [1], "the kill must land in round 2"
        hold.unlink()
        procs["server-again"] = start(server, logs["server-again"])
        for name in ("server-again", "0", "1"):
            assert procs[name].wait(120) == 0, logs[name].read_text()[-3000:]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
    assert [r["round"] for r in records(run_dir)] == [1, 2, 3]
    assert "resuming" in logs["server-again"].read_text()
    if strategy == "scaffold":  # each client's control variate of the lost round 2 was dropped
        for cid in ("0", "1"):
            assert f"client {cid}: the server did not apply its round 2 update" in logs[cid].read_text()
    monkeypatch.syspath_prepend(str(HERE))  # the slow-link plugin, idle without its hold file
    uninterrupted = runner.run_config(config_mod.load(config, ["transport=inmemory"]), tmp_path / "reference").params
    restarted = rundir.load_model(run_dir)
    assert restarted.keys() == uninterrupted.keys()
    for name, tensor in uninterrupted.items():
        assert torch.equal(restarted[name], tensor), name


def test_a_server_started_on_a_finished_run_serves_no_round(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Without its model the run's server died after the last checkpoint, before its clients heard
    the end: the next one tells the clients that come back to stop and writes the model. With it,
    the server returns at once."""
    from test_settled_state import FAST_GRPC, grpc_clients

    from conftest import free_port, small_config
    from fedweave import rundir

    port = free_port()
    config = small_config(*FAST_GRPC, f"grpc.listen=127.0.0.1:{port}", "clients=2", "grpc.join_timeout=30")
    with grpc_clients(config, f"127.0.0.1:{port}"):
        serve(config, tmp_path)
    model, metrics = rundir.load_model(tmp_path), (tmp_path / rundir.METRICS_FILE).read_text()
    (tmp_path / rundir.MODEL_FILE).unlink()
    caplog.clear()
    with caplog.at_level("INFO"), grpc_clients(config, f"127.0.0.1:{port}"):
        again = serve(config, tmp_path)
        # each client logs the end as its call returns, a moment after the server
        poll(lambda: caplog.text.count("the server ended the run") >= 2, 10)
        assert caplog.text.count("the server ended the run") == 2  # both clients told, before they are stopped
    assert again.first_round == 4 and (tmp_path / rundir.METRICS_FILE).read_text() == metrics
    restored = rundir.load_model(tmp_path)
    assert restored.keys() == model.keys() and all(torch.equal(restored[k], model[k]) for k in model)
    began = time.monotonic()
    with caplog.at_level("INFO"):
        serve(config, tmp_path)
    assert time.monotonic() - began < config.grpc.join_timeout / 2  # nobody to wait for (30 s to tell)
    assert f"the run in {tmp_path} already finished all 3 rounds" in caplog.text


def test_a_server_started_on_a_finished_he_run_writes_no_plaintext_model(tmp_path: Path) -> None:
    """Plugin he: the server's plaintext params stay w_0 and its result is model.he.pt. Started again on
    the finished run it looked for model.pt, which it never writes: it waited grpc.join_timeout for the
    clients every time, then wrote w_0 as the run's model.pt. Now it returns at once; without
    model.he.pt it writes it again from the checkpoint's encrypted model, and no model.pt."""
    from test_settled_state import FAST_GRPC, grpc_clients

    from conftest import free_port, small_config
    from fedweave import rundir
    from fedweave.cli import main

    assert main(["keys", "--out", str(tmp_path / "keys")]) == 0
    address = f"127.0.0.1:{free_port()}"
    config = small_config(*FAST_GRPC, f"grpc.listen={address}", "clients=2", "rounds=1", "grpc.join_timeout=30",
                          f"plugins.client_send=[{{name: he, keys: {tmp_path / 'keys'}}}]", "eval.every=0")
    run_dir = tmp_path / "run"
    with grpc_clients(config, address):
        serve(config, run_dir)
    sealed = torch.load(run_dir / rundir.SEALED_MODEL_FILE)
    assert not (run_dir / rundir.MODEL_FILE).exists()
    began = time.monotonic()
    serve(config, run_dir)
    assert time.monotonic() - began < config.grpc.join_timeout / 2 and not (run_dir / rundir.MODEL_FILE).exists()
    (run_dir / rundir.SEALED_MODEL_FILE).unlink()
    with grpc_clients(config, address):
        serve(config, run_dir)
    again = torch.load(run_dir / rundir.SEALED_MODEL_FILE)
    assert again.keys() == sealed.keys() and all(torch.equal(again[k], sealed[k]) for k in sealed)
    assert not (run_dir / rundir.MODEL_FILE).exists()


def test_a_server_no_client_reached_fails_with_one_line_and_writes_no_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 26 item 8: `fedweave server` that no client reached skipped every round, exited 0 and wrote
    w_0 as the run's model.pt. Now it exits 1 with one line, writes no model, and its run directory
    resumes from its start (a checkpoint of round 0, the skipped rounds' metrics lines dropped)."""
    from test_settled_state import FAST_GRPC

    from conftest import free_port, small_config
    from fedweave import rundir, runner
    from fedweave.checkpoint import load_checkpoint
    from fedweave.cli import main

    config = small_config(*FAST_GRPC, f"grpc.listen=127.0.0.1:{free_port()}", "clients=2", "rounds=2",
                          "grpc.join_timeout=1", "grpc.heartbeat_timeout=1", "checkpoint.every=1")
    path = tmp_path / "server.yaml"
    path.write_text(config_mod.to_yaml(config))
    run_dir = tmp_path / "run"
    capsys.readouterr()
    sigterm = signal.getsignal(signal.SIGTERM)  # a node's handler, put back for the rest of the tests
    try:
        assert main(["server", str(path), "--run-dir", str(run_dir), "-q"]) == 1
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("fedweave: error:")]
    assert errors == [
        "fedweave: error: the run trained nothing: each of the 2 rounds it ran was skipped (too few clients "
        f"answered); no model was written, and the run resumes from its start: fedweave server --resume {run_dir}"
    ]
    assert not (run_dir / rundir.MODEL_FILE).exists() and load_checkpoint(run_dir)["round"] == 0
    assert (run_dir / rundir.METRICS_FILE).read_text() == ""
    again = runner.resume(run_dir)
    again.parts.topology.close()
    assert (again.first_round, again.records) == (1, [])


def test_a_site_file_and_the_flags_become_the_clients_own_data_and_overrides_of_its_site_keys(tmp_path: Path) -> None:
    """`fedweave client --site FILE` (data, device, threads) and `--data`, `--device`, which win: the file the
    client alone reads (a relative path the site file's), and dotted overrides of local.device and threads."""
    from fedweave.nodes.client import site_data, site_overrides

    site = tmp_path / "site.yaml"
    site.write_text("data: rows/site-3.csv\ndevice: cpu\nthreads: 2\n")
    assert site_overrides(site) == ['local.device="cpu"', "threads=2"]
    assert site_overrides(site, device="cuda:1") == ['local.device="cuda:1"', "threads=2"]
    assert site_overrides(device="mps") == ['local.device="mps"'] and site_overrides() == []
    assert site_data(site) == f"{tmp_path}/rows/site-3.csv"
    assert site_data(site, "/data/a b.csv") == "/data/a b.csv" and site_data() is None
    loaded = config_mod.load(None, ["clients=2", *site_overrides(device="cpu")])
    assert loaded.local.device == "cpu"
    site.write_text("data: x.csv\nrounds: 3\n")
    with pytest.raises(ConfigError, match=r"^site file '.*site.yaml': key 'rounds' is not a site's own setting"):
        site_overrides(site)


def test_fedweave_client_applies_its_site_file_to_its_own_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A site file's threads reach the client's config (checked at load, one line naming the key)."""
    from fedweave.cli import main

    path = tmp_path / "fed.yaml"
    path.write_text("name: fed\nclients: 2\ntransport: grpc\n")
    site = tmp_path / "site.yaml"
    site.write_text("threads: -1\n")
    sigterm = signal.getsignal(signal.SIGTERM)  # a node's handler, put back for the rest of the tests
    try:
        assert main(["client", str(path), "--id", "0", "--site", str(site)]) == 2
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("fedweave: error: config key 'threads'")


def test_a_second_server_on_a_run_directory_is_refused_while_the_first_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 26 item 5: the second `fedweave server` on the same --run-dir says which process writes
    it, exits 1 and listens nowhere; the first keeps the run (it waits for its clients here)."""
    from launchers.test_process import start, wait_for, write_config

    from conftest import free_port
    from fedweave.cli import main

    config = write_config(tmp_path / "c.yaml", tmp_path / "hold", plugins={}, grpc={"join_timeout": 120})
    run_dir, address = tmp_path / "run", tmp_path / "address"
    first = start(["server", str(config), "--run-dir", str(run_dir), "--listen", "127.0.0.1:0",
                   "--address-file", str(address), "-q"], tmp_path / "first.log")
    try:
        wait_for(address.exists, 120, "the first server to listen")
        port = free_port()
        assert main(["server", str(config), "--run-dir", str(run_dir), "--listen", f"127.0.0.1:{port}", "-q"]) == 1
        assert capsys.readouterr().err.splitlines()[-1] == (
            f"fedweave: error: run directory '{run_dir}' is in use by process {first.pid}, which holds run.lock in "
            "it; wait for that process to end or stop it, or choose another directory"
        )
        assert first.poll() is None
    finally:
        first.kill()
        first.wait(10)


def test_fedweave_site_on_a_star_config_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 26 item 10: `fedweave site` on a config without sites ended in a traceback."""
    from fedweave.cli import main

    path = tmp_path / "star.yaml"
    path.write_text("name: star\nclients: 2\ntransport: grpc\n")
    for rank in ("0", "1"):
        assert main(["site", str(path), "--site", "0", "--rank", rank]) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == (
            "fedweave: error: config key 'topology.kind': `fedweave site` runs a site of a hierarchical topology "
            "with inner torchdist over transport grpc; this config has topology 'star' over 'grpc' (its clients are "
            "`fedweave client` nodes, or run inside `fedweave run`)"
        )
