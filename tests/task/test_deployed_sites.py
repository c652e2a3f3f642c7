"""Sites that read only their own data, deployed: three client processes over gRPC with mutual TLS,
each naming its CSV on its command line (``--data``), and a server started with no data path. Its
metrics and final model equal the simulation of the same files through the ``{client}`` template."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from conftest import free_port
from launchers.test_process import start
from fedweave import config as config_mod
from fedweave import rundir, runner
from fedweave.transports.grpc.certs import make_credentials

from .conftest import assert_same_run, blobs, write_csv

SIZES = [30, 40, 50]


def test_three_sites_over_mtls_each_reading_its_own_csv_equal_the_simulation(tmp_path: Path) -> None:
    pytest.importorskip("grpc")
    for client, size in enumerate(SIZES):
        write_csv(tmp_path / f"site_{client}.csv", *blobs(size, seed=client))
    write_csv(tmp_path / "test.csv", *blobs(60, seed=99))
    options = {"label": "label", "num_classes": 3, "test_path": str(tmp_path / "test.csv")}
    federation = {
        "name": "sites", "seed": 3, "rounds": 3, "clients": 3,
        "task": {"dataset": "files", "dataset_options": options, "model_options": {"hidden": [16]}},
        "local": {"epochs": 1, "batch_size": 8, "lr": 0.1},
        "eval": {"every": 1, "federated_every": 3},
        "checkpoint": {"every": 0},
        "transport": "grpc",
        "grpc": {"tls": "mtls", "credentials": str(make_credentials(tmp_path / "certs", 3)), "join_timeout": 60,
                 "connect_timeout": 60},
    }
    path = tmp_path / "federation.yaml"
    path.write_text(yaml.safe_dump(federation))
    address = f"127.0.0.1:{free_port()}"
    run_dir = tmp_path / "run"
    logs = {name: tmp_path / f"{name}.log" for name in ("server", "0", "1", "2")}
    procs = {"server": start(["server", str(path), "--run-dir", str(run_dir), "--listen", address, "-q"], logs["server"])}
    for cid in range(3):
        data = str(tmp_path / f"site_{cid}.csv")
        procs[str(cid)] = start(["client", str(path), "--id", str(cid), "--address", address, "--data", data], logs[str(cid)])
    try:
        for name, proc in procs.items():
            assert proc.wait(180) == 0, logs[name].read_text()[-3000:]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
    deployed_records = rundir.records_until(run_dir, "round", 3)
    simulated = config_mod.from_dict(
        federation | {"transport": "inmemory", "grpc": {},
                      "task": federation["task"] | {"dataset_options": options | {"path": str(tmp_path / "site_{client}.csv")}}}
    )
    reference = runner.run_config(simulated, tmp_path / "reference")
    assert len(deployed_records) == 3
    assert_same_run(reference.records, deployed_records)
    deployed = rundir.load_model(run_dir)
    assert deployed.keys() == reference.params.keys()
    for name, tensor in reference.params.items():
        torch.testing.assert_close(deployed[name], tensor, rtol=1e-6, atol=1e-7, msg=name)
    assert "site_" not in logs["server"].read_text()  # the server never hears of a site's file
    assert "client 0 built (" in logs["0"].read_text()
