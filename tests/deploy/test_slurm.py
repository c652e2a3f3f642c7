"""deploy/slurm's sbatch scripts, submitted with sbatch to a one-machine Slurm cluster.

The federated job runs examples/digits-grpc.yaml as a gRPC server task and two client
tasks with mutual TLS and tokens; its model and metrics equal the in-memory run of the same
config and seed as tests/scenarios/test_deploy_equivalence.py asks of the process launcher (params
≤ 1e-5, metrics ≤ 1e-6). The data-parallel job starts one torchrun agent on the node, which
runs two workers on the step's two CPUs (``--cpus-per-task=2``, which srun no longer inherits
from the job since Slurm 22.05); its model is the one a single process trains on the same global
batches.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from conftest import assert_same_params, free_port, reference
from fedweave import config as config_mod
from fedweave import runner

from . import slurm_cluster as cluster_mod
from .slurm_cluster import SlurmCluster, slurm_cluster  # noqa: F401 - the fixture

ROOT = Path(__file__).resolve().parents[2]
FEDERATED = ROOT / "deploy" / "slurm" / "federated.sbatch"
DATA_PARALLEL = ROOT / "deploy" / "slurm" / "data-parallel.sbatch"
EXAMPLE = ROOT / "examples" / "digits-grpc.yaml"
SMALL = ["clients=2", "rounds=2", "eval.federated_every=0", "task.model_options={hidden: [16]}"]
JOB_TIMEOUT = 120.0
JOB_ENV = {"OMP_NUM_THREADS": "1"}
DP = {
    "name": "slurm-dp",
    "seed": 0,
    "mode": "data_parallel",
    "task": {
        "dataset": "synthetic",
        "dataset_options": {"samples": 600, "features": 8, "classes": 4},
        "model_options": {"hidden": [16]},
    },
    "data_parallel": {"workers": 2, "global_batch": 48, "epochs": 2, "lr": 0.1, "momentum": 0.9, "log_every": 5},
}


def records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def run_job(cluster: SlurmCluster, script: Path, tmp_path: Path, args: list[str], options: list[str],
            env: dict[str, str]) -> str:
    """Submit ``script`` from ``tmp_path``, wait for it, fail with its output unless it completed; its output."""
    out = tmp_path / "job.out"
    job = cluster.submit(
        script, *args, options=(f"--chdir={tmp_path}", f"--output={out}", "--time=5", *options),
        env={**JOB_ENV, "FEDWEAVE_PORT": str(free_port()), **env},
    )
    fields = cluster.wait(job, JOB_TIMEOUT)
    output = out.read_text(errors="replace") if out.exists() else "(no output)"
    if (fields.get("JobState"), fields.get("ExitCode")) != ("COMPLETED", "0:0"):
        pytest.fail(f"job {job} ended {fields.get('JobState')} {fields.get('ExitCode')}:\n{output[-4000:]}\n{cluster.logs()}")
    return output


def test_the_federated_script_runs_a_grpc_deployment_equal_to_the_local_run(
    slurm_cluster: SlurmCluster, tmp_path: Path  # noqa: F811 - the fixture
) -> None:
    run_dir = tmp_path / "run"
    env = {"FEDWEAVE": f"{sys.executable} -m fedweave", "FEDWEAVE_RUN_DIR": str(run_dir)}
    output = run_job(slurm_cluster, FEDERATED, tmp_path, [str(EXAMPLE), *SMALL], ["--ntasks=3"], env)
    assert "server on localhost:" in output

    deployed = records(run_dir)
    assert [r["round"] for r in deployed] == [1, 2]
    assert all(r["clients_completed"] == 2 for r in deployed)
    grpc = yaml.safe_load((run_dir / "config.yaml").read_text())["grpc"]
    assert (grpc["tls"], grpc["tokens"]) == ("mtls", True)
    assert (run_dir / "credentials" / "server.pem").is_file()
    assert not (run_dir / "credentials" / "ca.key").exists()

    local = runner.prepare(config_mod.load(EXAMPLE, [*SMALL, "transport=inmemory", "launcher=local"]), tmp_path / "local")
    expected = runner.execute(local)
    assert_same_params(local.params, torch.load(run_dir / "model.pt"), atol=1e-5)
    for a, b in zip(expected, deployed, strict=True):
        for key in ("train_loss", "test_loss", "test_accuracy"):
            assert b[key] == pytest.approx(a[key], abs=1e-6), key


def test_the_federated_script_refuses_a_task_count_that_is_not_clients_plus_one(
    slurm_cluster: SlurmCluster, tmp_path: Path  # noqa: F811 - the fixture
) -> None:
    out = tmp_path / "job.out"
    job = slurm_cluster.submit(
        FEDERATED, str(EXAMPLE), "clients=2",
        options=(f"--chdir={tmp_path}", f"--output={out}", "--ntasks=4"),
        env={**JOB_ENV, "FEDWEAVE": f"{sys.executable} -m fedweave"},
    )
    fields = slurm_cluster.wait(job, JOB_TIMEOUT)
    assert (fields["JobState"], fields["ExitCode"]) == ("FAILED", "2:0")
    assert "the config has 2 clients: submit with --ntasks=3, not 4" in out.read_text()
    assert not (tmp_path / "runs").exists()


def test_the_cluster_is_skipped_with_one_line_only_without_root_or_the_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster_mod.os, "geteuid", lambda: 1000)
    assert cluster_mod.missing() == "needs root to start munged, slurmctld and slurmd"
    monkeypatch.setattr(cluster_mod.os, "geteuid", lambda: 0)
    monkeypatch.setattr(cluster_mod.shutil, "which", lambda name: None if name in ("slurmd", "munged") else f"/usr/bin/{name}")
    assert cluster_mod.missing() == "needs Debian's slurm-wlm and munge packages (missing munged, slurmd)"


def torchrun_entry() -> bool:
    """Whether ``python -m fedweave.data_parallel`` exists (the package's ``__main__``)."""
    try:
        return importlib.util.find_spec("fedweave.data_parallel.__main__") is not None
    except ModuleNotFoundError:  # fedweave.data_parallel is still a module, not a package
        return False


@pytest.mark.skipif(not torchrun_entry(), reason="needs the torchrun entry point (fedweave.data_parallel as a module)")
def test_the_data_parallel_script_trains_the_model_of_one_process(
    slurm_cluster: SlurmCluster, tmp_path: Path  # noqa: F811 - the fixture
) -> None:
    config_path = tmp_path / "dp.yaml"
    config_path.write_text(yaml.safe_dump(DP))
    output_dir = tmp_path / "runs"
    # torchrun, started by srun, first writes down the CPUs it may run on (its workers inherit them)
    torchrun = tmp_path / "torchrun.sh"
    torchrun.write_text(f"""#!/bin/bash
{sys.executable} -c "import os; print(len(os.sched_getaffinity(0)))" > "{tmp_path}/cpus-$SLURM_PROCID.txt"
exec {sys.executable} -m torch.distributed.run "$@"
""")
    torchrun.chmod(0o755)
    env = {"TORCHRUN": str(torchrun), "FEDWEAVE_NPROC_PER_NODE": "2"}
    run_job(slurm_cluster, DATA_PARALLEL, tmp_path, [str(config_path), f"output_dir={output_dir}"],
            ["--nodes=1", "--cpus-per-task=2"], env)
    assert (tmp_path / "cpus-0.txt").read_text().split() == ["2"]  # the agent's CPUs, which its workers inherit

    (run_dir,) = [p.parent for p in output_dir.glob("*/metrics.jsonl")]
    config = config_mod.load(config_path)
    params, metrics = reference(config)
    trained = torch.load(run_dir / "model.pt")
    assert trained.keys() == params.keys()
    for k in params:
        torch.testing.assert_close(trained[k], params[k], rtol=1e-4, atol=2e-5, msg=lambda m: f"{k}: {m}")
    last = records(run_dir)[-1]
    assert last["epoch"] == pytest.approx(2.0)
    assert last["test_accuracy"] == pytest.approx(metrics["accuracy"])


@pytest.mark.parametrize("script", [DATA_PARALLEL, FEDERATED], ids=lambda p: p.name)
def test_every_srun_passes_the_jobs_cpus_per_task_on(script: Path) -> None:
    """Since Slurm 22.05 srun no longer reads SLURM_CPUS_PER_TASK: a step asks for the job's
    --cpus-per-task itself, or its tasks may be bound to one CPU each (on this test cluster's single
    task per node the step gets the job's CPUs either way, so the script's line is checked here)."""
    command = script.read_text().replace("\\\n", " ")
    (srun,) = [line.strip() for line in command.splitlines() if line.strip().startswith("srun ")]
    assert '--cpus-per-task="${SLURM_CPUS_PER_TASK:-1}"' in srun.split()
