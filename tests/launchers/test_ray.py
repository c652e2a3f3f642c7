"""The Ray launcher on a two-node Ray cluster that this file starts (one per module: Ray starts slowly)."""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import free_port
from ray_cluster import two_node_cluster

from fedweave import config as config_mod
from fedweave import runner
from fedweave import rundir
from fedweave.errors import ConfigError, FedweaveError, NothingTrained
from fedweave.launchers.ray import ActorPool, import_ray

START_TIMEOUT = 120.0
SAME = (
    "train_loss", "test_loss", "test_accuracy", "federated_loss", "federated_accuracy", "bytes_sent", "bytes_received"
)


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """The address of a two-node Ray cluster on this machine, one CPU per node (``ray_cluster``)."""
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'fedweave[ray]')")
    with two_node_cluster(cpus=1, timeout=START_TIMEOUT) as address:
        yield address


def _config(tmp_path: Path, *overrides: str) -> config_mod.Config:
    return config_mod.load(None, [
        "rounds=2",
        "clients=4",
        "task.dataset=digits",
        "task.model_options={hidden: [16]}",
        "local.batch_size=32",
        "eval.federated_every=1",
        f"output_dir={tmp_path}",
        "simulation.cohort=off",  # the sequential loop, as Ray's actors train: a cohort rounds differently
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
        # DP-SGD takes over training on the actor, from the actor's own chains; its report reaches the ledger
        ["plugins.client_receive=[{name: dpsgd, noise_multiplier: 0.8, seeded_noise: true}]"],
    ],
    ids=["scaffold-topk", "secagg", "dpsgd"],
)
def test_ray_run_equals_the_in_process_run(cluster: str, tmp_path: Path, same: list[str]) -> None:
    """4 clients on 2 actors (one per node): the same records and model as in process."""
    local = _run(tmp_path, "local", *same)
    remote = _run(tmp_path, "ray", *same, "launcher=ray", f"ray.address={cluster}", "ray.actors=2")
    assert len(remote.records) == len(local.records) == 2
    for a, b in zip(local.records, remote.records):
        assert b["clients_completed"] == a["clients_completed"] == 4
        for key in (*SAME, "epsilon") if "epsilon" in a else SAME:
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
    with pytest.raises(NothingTrained):  # its one round skipped: the run fails, and writes no model
        runner.execute(r)
    (record,) = r.records
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
    closed = f"127.0.0.1:{free_port()}"
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


LISTENING = """
import json
from fedweave import config
from fedweave.launchers.ray import join_ray
ray, owns = join_ray(config.load(None, ["launcher=ray"]))
import psutil  # (Ray's own copy, on the path once Ray is imported)
try:
    found = {c.laddr.ip for p in psutil.Process().children(recursive=True) if p.is_running()
             for c in p.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
finally:
    ray.shutdown()
print(owns, json.dumps(sorted(found)))
"""


def test_a_local_cluster_listens_on_the_loopback_interface_only(tmp_path: Path) -> None:
    """Issue 26 item 9: the cluster `launcher: ray` starts without ray.address listened on every interface."""
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'fedweave[ray]')")
    import json
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    done = subprocess.run([sys.executable, "-c", LISTENING], capture_output=True, text=True, timeout=START_TIMEOUT,
                          env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    owns, found = done.stdout.splitlines()[-1].split(" ", 1)
    assert owns == "True"
    found = json.loads(found)
    assert found and set(found) <= {"127.0.0.1", "::ffff:127.0.0.1"}, found
