"""Data-parallel training under torchrun across hosts: each host a network namespace with
its own address on one bridge (:mod:`netns`), one torchrun agent per host, the c10d
rendezvous on host 0's address, the run directory on storage all hosts see.

- two hosts train the model one process trains on the same global batches (float64,
  ≤ 1e-6 relative), with unequal b_i;
- a host killed with SIGKILL mid-epoch: the other goes on (torchrun re-forms the group
  within its rendezvous timeouts), resumes from the job's latest state, loses at most
  ``checkpoint_every`` steps, covers every sample of each epoch once (the model is still
  the one process's) and ends;
- a third host that starts its agent mid-run gets its share of the batch within two
  controller decisions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import netns
from conftest import reference
from fedweave import config as config_mod
from fedweave.data_parallel import torchrun

ROOT = Path(__file__).resolve().parents[2]
RDZV_CONF = "join_timeout=60,last_call_timeout=1,close_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3"
TIMEOUT = 90.0
CONFIG = {
    "name": "torchrun",
    "seed": 0,
    "mode": "data_parallel",
    "task": {
        "dataset": "synthetic",
        "dataset_options": {"samples": 600, "features": 8, "classes": 4},
        "model": "data_parallel.models:mlp64",
        "model_options": {"hidden": [16]},
    },
    # 480 training samples, 47 a step: 10 steps of 47 and one of 10 per epoch, split unequally
    "data_parallel": {"workers": 2, "global_batch": 47, "epochs": 2, "lr": 0.1, "momentum": 0.9, "log_every": 1,
                      "timeout": 10, "checkpoint_every": 4, "controller": {"every": 3}},
}

needs_hosts = pytest.mark.skipif(bool(netns.unavailable()), reason=netns.unavailable() or "")


@pytest.fixture
def hosts() -> Iterator[netns.Hosts]:
    made = netns.Hosts(3)
    try:
        made.lie_about_hostname()
        yield made
    finally:
        made.close()


def write_config(tmp_path: Path, **dp: Any) -> tuple[Path, config_mod.Config]:
    cfg = {**CONFIG, "data_parallel": {**CONFIG["data_parallel"], **dp}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, config_mod.load(path)


def agent(hosts: netns.Hosts, i: int, nnodes: str, config: Path, run_dir: Path, *overrides: str) -> subprocess.Popen[bytes]:
    """Host ``i``'s torchrun agent as the docs start it (``fedweave worker ... --rdzv-endpoint``, nothing
    about addresses or interfaces), output in ``run_dir/../agent-<i>.log``."""
    env = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")}
    env.update(PYTHONPATH=f"{ROOT / 'src'}:{ROOT / 'tests'}", OMP_NUM_THREADS="1", LOGLEVEL="INFO")
    log = (run_dir.parent / f"agent-{i}.log").open("wb")
    command = [
        *hosts.exec(i), sys.executable, "-m", "fedweave", "worker", str(config), *overrides, "--run-dir", str(run_dir),
        f"--nnodes={nnodes}", f"--rdzv-endpoint={hosts.address(0)}:29400", "--rdzv-id=job", "--max-restarts=3",
        f"--rdzv-conf={RDZV_CONF}",
    ]
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)


def records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def wait_for(run_dir: Path, written: Callable[[dict[str, Any]], bool], agents: list[subprocess.Popen[bytes]]) -> int:
    """Wait until the last metrics line is ``written``; its step."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        lines = records(run_dir)
        if lines and written(lines[-1]):
            return int(lines[-1]["step"])
        assert all(a.poll() is None for a in agents), "an agent ended early"
        time.sleep(0.02)
    raise AssertionError(f"the metrics did not reach the awaited line in {TIMEOUT} s")


def finish(agents: list[subprocess.Popen[bytes]], tmp_path: Path) -> None:
    for i, a in enumerate(agents):
        try:
            code = a.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            a.kill()
            code = None
        logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(tmp_path.glob("agent-*.log")))
        assert code == 0, f"agent {i} ended with {code}:\n{logs}"


def assert_matches_reference(run_dir: Path, config: config_mod.Config) -> None:
    params, _ = reference(config)
    trained = torch.load(run_dir / "model.pt")
    assert trained.keys() == params.keys()
    for k in params:
        assert params[k].dtype == torch.float64
        torch.testing.assert_close(trained[k], params[k], rtol=1e-6, atol=0.0, msg=lambda m: f"{k}: {m}")


def assert_each_epoch_covers_every_sample_once(written: list[dict[str, Any]], epochs: int) -> None:
    """One record per step (log_every 1) after a resume's truncation: steps 1..n in order, the
    samples of each epoch adding up to the training set."""
    assert [r["step"] for r in written] == list(range(1, len(written) + 1))
    per_epoch = [0] * epochs
    for r in written:
        per_epoch[min(int(r["epoch"] - 1e-9), epochs - 1)] += r["samples"]
    assert per_epoch == [480] * epochs
    assert written[-1]["epoch"] == epochs


def test_a_worker_outside_torchrun_is_refused_with_one_line(tmp_path: Path) -> None:
    path, _ = write_config(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in torchrun.ENV}
    env["PYTHONPATH"] = f"{ROOT / 'src'}:{ROOT / 'tests'}"
    done = subprocess.run([sys.executable, "-m", "fedweave.data_parallel", str(path)], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "fedweave: error: not started by torchrun: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT unset "
        "(run `torchrun ... -m fedweave.data_parallel CONFIG`)"
    ]


def test_the_workers_agree_on_the_run_directory_from_the_rendezvous_id(tmp_path: Path) -> None:
    _, config = write_config(tmp_path)
    env = torchrun.TorchrunEnv.read({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "h",
                                     "MASTER_PORT": "1", "GROUP_RANK": "1", "TORCHELASTIC_RUN_ID": "4711"})
    assert (env.rank, env.world_size, env.local_rank, env.group_rank, env.restart_count) == (3, 4, 1, 1, 0)
    assert torchrun.agreed_run_dir(config, env) == Path("runs") / "torchrun-4711"
    assert torchrun.agreed_run_dir(config, env, tmp_path / "mine") == tmp_path / "mine"


@needs_hosts
def test_two_hosts_whose_hostname_resolves_to_loopback_train_the_model_of_one_process(
    hosts: netns.Hosts, tmp_path: Path,
) -> None:
    check = "import socket; print(socket.gethostbyname(socket.gethostname()))"
    assert subprocess.run([*hosts.exec(1), sys.executable, "-c", check], capture_output=True, text=True, timeout=30,
                          check=True).stdout.strip() == "127.0.0.1"  # the hostname lies, as the did
    path, config = write_config(tmp_path)
    run_dir = tmp_path / "run"
    finish([agent(hosts, i, "2", path, run_dir) for i in range(2)], tmp_path)
    written = records(run_dir)
    assert written[-1]["workers"] == [0, 1] and written[-1]["epoch"] == 2
    assert any(r["batch"][0] != r["batch"][1] for r in written)  # unequal b_i
    assert_matches_reference(run_dir, config)


@needs_hosts
def test_a_host_killed_mid_epoch_the_other_goes_on(hosts: netns.Hosts, tmp_path: Path) -> None:
    path, config = write_config(tmp_path)  # 2 epochs of 11 steps: killed at step 14, in the second
    run_dir = tmp_path / "run"
    agents = [agent(hosts, i, "1:2", path, run_dir, "heterogeneity.slowdown=100") for i in range(2)]
    before = wait_for(run_dir, lambda last: last["step"] >= 14, agents)  # in the second epoch
    assert before < 22, "the run ended before the kill"
    hosts.kill(1)
    # the survivor's collective breaks at once; torchrun drops the dead host after 3 keep-alives of 1 s,
    # waits the last call (1 s), and starts the worker again: a new generation of one worker, within
    # wait_for's bound (no wall-clock bound of its own: a loaded host starts torch slowly)
    wait_for(run_dir, lambda last: last["generation"] > 0, agents[:1])
    finish(agents[:1], tmp_path)
    assert agents[1].poll() is not None  # the killed host's agent is gone: the survivor finished alone
    survivor = (tmp_path / "agent-0.log").read_text(errors="replace")
    assert "fedweave: warning: worker 0 stopped at step" in survivor and "fedweave: error:" not in survivor
    written = records(run_dir)
    assert all(r["workers"] == [0, 1] for r in written if r["generation"] == 0)  # both hosts until the kill
    resumed = next(r for r in written if r["generation"] > 0)
    assert resumed["workers"] == [0] and all(r["workers"] == [0] for r in written if r["generation"] > 0)
    assert resumed["step"] - 1 >= before - config.data_parallel.checkpoint_every  # steps lost ≤ the cadence
    assert_each_epoch_covers_every_sample_once(written, 2)
    assert_matches_reference(run_dir, config)


@needs_hosts
def test_a_third_host_joining_gets_its_share_within_two_decisions(hosts: netns.Hosts, tmp_path: Path) -> None:
    path, config = write_config(tmp_path, epochs=3)
    run_dir = tmp_path / "run"
    # ~1.3 s a step, ~44 s for the run's 33: the third agent starts (~5 s quiet, ~23 s seen at load 8) well before the
    # end (at 0.8 s a step, a 26 s run, a loaded machine left it ~3 s)
    slow = "heterogeneity.slowdown=1000"
    agents = [agent(hosts, i, "2:3", path, run_dir, slow) for i in range(2)]
    wait_for(run_dir, lambda last: last["step"] >= 2, agents)
    agents.append(agent(hosts, 2, "2:3", path, run_dir, slow))
    finish(agents, tmp_path)
    written = records(run_dir)
    before = [r for r in written if len(r["workers"]) == 2]
    after = [r for r in written if len(r["workers"]) == 3]
    assert before and after, "the third host never took part"
    first = after[0]
    assert first["batch"][2] > 0 and first["adjustments"] - before[-1]["adjustments"] <= 2
    assert_each_epoch_covers_every_sample_once(written, 3)
    assert_matches_reference(run_dir, config)


def test_a_second_job_on_the_run_directory_is_refused_by_its_first_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 26 item 5: rank 0 of a job writes its run directory; while another process does, rank 0
    of a second job says which and leaves the directory untouched."""
    from conftest import free_port
    from fedweave import rundir
    from test_rundir import held

    _, config = write_config(tmp_path)
    environ = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(free_port()), "FEDWEAVE_HEARTBEAT": str(tmp_path / "heartbeat")}
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    with held(tmp_path / "run") as holder:
        with pytest.raises(rundir.RunInUse, match=f"is in use by process {holder.pid}"):
            torchrun.run(config, tmp_path / "run", environ)
        assert [p.name for p in (tmp_path / "run").iterdir()] == ["run.lock"]
    assert (tmp_path / "heartbeat").exists()  # the worker's liveness file (issue 27), from its start


def test_a_rank_outside_the_world_is_one_line(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    """Issue 26 item 10: `fedweave worker` with RANK >= WORLD_SIZE (or a rank that is no number) ended
    in a traceback."""
    from fedweave.cli import main

    path, _ = write_config(tmp_path)
    base = {"WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for rank, why in [("3", "RANK=3 is not a rank of a world of WORLD_SIZE=2 (ranks 0..1)"),
                      ("x", "RANK='x': torchrun sets it to a whole number 0 or more")]:
        for name, value in {**base, "RANK": rank}.items():
            monkeypatch.setenv(name, value)
        assert main(["worker", str(path), "--run-dir", str(tmp_path / "run")]) == 1
        assert capsys.readouterr().err.strip().splitlines() == [f"fedweave: error: {why}"]
    assert not (tmp_path / "run").exists()
