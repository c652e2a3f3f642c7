"""The Ray launcher on a two-node Ray cluster that this file starts (one per module: Ray starts slowly)."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import fedweave
from fedweave import config as config_mod
from fedweave import runner
from fedweave import rundir
from fedweave.errors import ConfigError, FedweaveError
from fedweave.launchers.ray import ActorPool, import_ray

START_TIMEOUT = 120.0
SAME = (
    "train_loss", "test_loss", "test_accuracy", "federated_loss", "federated_accuracy", "bytes_sent", "bytes_received"
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each node's process group (raylet, GCS, workers), then SIGKILL what is left, bounded."""
    for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 10.0)):
        for p in procs:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.2)
    for p in procs:
        p.wait(timeout=5.0)


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """The address of a two-node Ray cluster on this machine, one CPU per node, each node with its
    own temp folder; its workers import this checkout's fedweave."""
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'fedweave[ray]')")
    port = _free_port()
    address = f"127.0.0.1:{port}"
    src = str(Path(fedweave.__file__).resolve().parents[1])
    env = {
        **os.environ,
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "disabled",
        "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)  # 0 would forbid a second node
    ray_cli = str(Path(sys.executable).with_name("ray"))
    common = ["--block", "--node-ip-address=127.0.0.1", "--num-cpus=1", "--disable-usage-stats"]
    driver_auth = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"  # the driver as the nodes, whatever token ~/.ray may hold
    procs: list[subprocess.Popen[bytes]] = []
    temps = [tempfile.mkdtemp(prefix="fwray-") for _ in range(2)]  # short: Ray's socket paths live here
    logs = [open(Path(t, "start.log"), "wb") for t in temps]  # noqa: SIM115 (closed below)

    def start(args: list[str], i: int) -> None:
        procs.append(subprocess.Popen(
            [ray_cli, "start", *args, *common, f"--temp-dir={temps[i]}"],
            env=env, stdout=logs[i], stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        ))

    try:
        start(["--head", f"--port={port}", "--include-dashboard=false"], 0)
        deadline = time.monotonic() + START_TIMEOUT
        while not _listening(port):
            assert procs[0].poll() is None and time.monotonic() < deadline, "the Ray head did not start"
            time.sleep(0.5)
        start([f"--address={address}"], 1)
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
        try:
            while len([n for n in ray.nodes() if n["Alive"]]) < 2:
                assert procs[1].poll() is None and time.monotonic() < deadline, "the second Ray node did not join"
                time.sleep(0.5)
        finally:
            ray.shutdown()
        yield address
    finally:
        _stop(procs)
        for f in logs:
            f.close()
        for t in temps:
            shutil.rmtree(t, ignore_errors=True)
        if driver_auth is None:
            del os.environ["RAY_AUTH_MODE"]
        else:
            os.environ["RAY_AUTH_MODE"] = driver_auth


def _config(tmp_path: Path, *overrides: str) -> config_mod.Config:
    return config_mod.load(None, [
        "rounds=2",
        "clients=4",
        "task.dataset=digits",
        "task.model_options={hidden: [16]}",
        "local.batch_size=32",
        "eval.federated_every=1",
        f"output_dir={tmp_path}",
        *overrides,
    ])


def _run(tmp_path: Path, name: str, *overrides: str) -> runner.Run:
    r = runner.prepare(_config(tmp_path, *overrides), tmp_path / name)
    runner.execute(r)
    return r


@pytest.mark.parametrize(
    "same",
    [
        # client state travels with the work; top-k's error feedback is client-side plugin state
        ["strategy.name=scaffold", "plugins.client_send=[{name: topk, ratio: 0.5}]"],
        # secure aggregation: control steps answered, and their secrets kept, in the driver
        ["plugins.client_send=[{name: secagg, seeded_noise: true}]"],
    ],
    ids=["scaffold-topk", "secagg"],
)
def test_ray_run_equals_the_in_process_run(cluster: str, tmp_path: Path, same: list[str]) -> None:
    """4 clients on 2 actors (one per node): the same records and model as in process."""
    local = _run(tmp_path, "local", *same)
    remote = _run(tmp_path, "ray", *same, "launcher=ray", f"ray.address={cluster}", "ray.actors=2")
    assert len(remote.records) == len(local.records) == 2
    for a, b in zip(local.records, remote.records):
        assert b["clients_completed"] == a["clients_completed"] == 4
        for key in SAME:
            assert b[key] == pytest.approx(a[key], abs=1e-6), key
    for name, value in local.params.items():
        torch.testing.assert_close(remote.params[name], value, rtol=0, atol=1e-6)
    assert remote.store.state_dict().keys() == local.store.state_dict().keys()


def test_many_clients_share_a_pool_the_size_of_the_cluster(cluster: str, tmp_path: Path) -> None:
    """40 clients, 10 sampled, no ray.actors: one actor per CPU of the cluster (2) trains them all."""
    r = runner.prepare(
        _config(tmp_path, "rounds=1", "clients=40", "sample_fraction=0.25", "eval.federated_every=0",
                "launcher=ray", f"ray.address={cluster}"),
        tmp_path / "r",
    )
    pool = r.parts.topology.transport.pool
    assert len(pool.slots) == 2
    (record,) = runner.execute(r)
    assert (record["clients_sampled"], record["clients_completed"]) == (10, 10)
    assert pool.replaced == 0


class _KillFirstActor(logging.Handler):
    """Kills (SIGKILL) the actor that round 1's first client is sent to, as it is sent."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.killed: tuple[int, int] | None = None

    def emit(self, record: logging.LogRecord) -> None:
        pid = getattr(record, "ray_actor_pid", None)
        if self.killed is None and pid is not None and getattr(record, "round", None) == 1:
            os.kill(pid, signal.SIGKILL)
            self.killed = (record.client_id, pid)  # type: ignore[attr-defined]


def test_an_actor_killed_mid_round_drops_only_its_client(cluster: str, tmp_path: Path) -> None:
    logger = logging.getLogger("fedweave.launchers.ray")
    killer, level = _KillFirstActor(), logger.level
    logger.addHandler(killer)
    logger.setLevel(logging.DEBUG)
    try:
        r = runner.prepare(_config(tmp_path, "launcher=ray", f"ray.address={cluster}", "ray.actors=2"), tmp_path / "r")
        pool = r.parts.topology.transport.pool
        runner.execute(r)
    finally:
        logger.removeHandler(killer)
        logger.setLevel(level)
    assert killer.killed is not None
    first, second = r.records
    assert (first["clients_sampled"], first["clients_completed"]) == (4, 3)  # only the killed actor's client
    assert (second["clients_sampled"], second["clients_completed"]) == (4, 4)  # the pool is whole again
    assert pool.replaced == 1
    assert (r.run_dir / rundir.MODEL_FILE).is_file()


def test_work_past_the_deadline_is_dropped_and_its_actors_replaced(cluster: str, tmp_path: Path) -> None:
    """100,000 local steps take far more than the 1 s deadline: the round is skipped, both busy actors
    are replaced (and stop working at once)."""
    r = runner.prepare(
        _config(tmp_path, "rounds=1", "round_timeout=1", "local.steps=100000", "eval.federated_every=0",
                "launcher=ray", f"ray.address={cluster}", "ray.actors=2"),
        tmp_path / "r",
    )
    pool = r.parts.topology.transport.pool
    (record,) = runner.execute(r)
    assert record["skipped"] and record["clients_completed"] == 0
    assert pool.replaced == 2


def test_actors_the_cluster_cannot_place_fail_the_run_before_round_1(
    cluster: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No node has 2 CPUs: after ray.start_timeout one line says so, and the waiting actor is killed."""
    killed: list[int] = []
    close = ActorPool.close
    monkeypatch.setattr(ActorPool, "close", lambda pool: (killed.append(len(pool.slots)), close(pool))[1])
    config = _config(tmp_path, "launcher=ray", f"ray.address={cluster}", "ray.actors=1", "ray.num_cpus=2",
                     "ray.start_timeout=2")
    with pytest.raises(FedweaveError, match=r"1 of 1 Ray actors did not start within ray.start_timeout=2.0 s"):
        runner.prepare(config, tmp_path / "r")
    assert killed == [1]


def test_without_ray_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # what an environment without Ray imports
    with pytest.raises(FedweaveError, match=r"pip install 'fedweave\[ray\]'"):
        import_ray()


def test_an_unreachable_cluster_fails_at_once_with_one_line(tmp_path: Path) -> None:
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'fedweave[ray]')")
    closed = f"127.0.0.1:{_free_port()}"
    with pytest.raises(FedweaveError, match=f"cannot reach the Ray cluster at ray.address='{closed}'"):
        runner.prepare(_config(tmp_path, "launcher=ray", f"ray.address={closed}"), tmp_path / "r")
    assert not (tmp_path / "r").exists()  # a run that could not be built leaves no directory


def test_config_refuses_what_the_ray_launcher_cannot_run() -> None:
    with pytest.raises(ConfigError, match="config key 'launcher': 'ray'"):
        config_mod.load(None, ["launcher=ray", "transport=grpc"])
    with pytest.raises(ConfigError, match="config key 'launcher': 'ray'"):
        config_mod.load(None, ["launcher=ray", "clients=2", "heterogeneity.speeds=[1, 2]"])
    with pytest.raises(ConfigError, match="ray.num_cpus"):
        config_mod.load(None, ["launcher=ray", "ray.num_cpus=0"])
