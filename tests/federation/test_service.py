"""The federation as a service, end to end on 127.0.0.1: one long-lived federation server and three
sites that joined it once (processes), mutual TLS, each site with its own CSV of scikit-learn's
digits in its catalogue. The federation and sites are built from examples/federation/ (FED.yaml,
SITE.yaml, JOB.yaml), each site's policy its own: gamma allows only fedavg and no code bundles.

The tests share the federation (it is long-lived: that is what they show) and run in file order;
each submits its own jobs and waits for them, with bounded waits."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from conftest import free_port
from launchers.test_process import start

from fedweave import config as config_mod
from fedweave import rundir, runner
from fedweave.cli.main import main
from fedweave.federation.admin import Admin, FederationRefused
from fedweave.federation.audit import AuditLog
from fedweave.federation.bundle import digest, pack
from fedweave.federation.config import AdminConfig
from fedweave.transports.grpc.certs import make_credentials

pytest.importorskip("grpc")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "federation"
SITES = ("alpha", "beta", "gamma")
ROWS = {"alpha": (0, 150), "beta": (150, 330), "gamma": (330, 540)}
POLICIES = {
    "alpha": {"code": "any"},
    "beta": {"code": "any"},
    "gamma": {"code": "never", "strategies": ["fedavg"]},
}
WAIT = 150.0


@dataclass
class Federation:
    root: Path
    address: str
    fed_file: Path
    site_files: dict[str, Path]
    admin: Admin
    procs: dict[str, subprocess.Popen[bytes]]
    test_csv: Path

    def start_server(self) -> None:
        self.procs["server"] = start(["federation", "serve", str(self.fed_file)], self.root / "server.log")

    def job(self, base: dict[str, Any] | None = None, **changes: Any) -> dict[str, Any]:
        job = copy.deepcopy(base or self.example_job())
        job.update(changes)
        return job

    def example_job(self) -> dict[str, Any]:
        job = yaml.safe_load((EXAMPLES / "JOB.yaml").read_text())
        job["task"]["dataset_options"]["test_path"] = str(self.test_csv)
        job["task"]["model_options"] = {"hidden": [16]}
        job["eval"] = {"every": 1}
        job["grpc"] = {"join_timeout": 60, "connect_timeout": 60}
        return job

    def wait(self, job: str, states: tuple[str, ...] = ("finished", "failed", "cancelled", "refused"),
             timeout: float = WAIT) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            record = self.admin.job(job)
            if record["state"] in states:
                return record
            for name, proc in self.procs.items():
                assert proc.poll() is None, f"{name} exited: {self.log(name)}"
            time.sleep(0.25)
        raise AssertionError(f"{job} is {self.admin.job(job)['state']} after {timeout} s:\n{self.admin.logs(job)[-3000:]}")

    def wait_for(self, check: Callable[[], bool], what: str, timeout: float = WAIT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if check():
                return
            time.sleep(0.2)
        raise AssertionError(f"no {what} within {timeout} s")

    def all_online(self) -> bool:
        try:
            sites = self.admin.jobs()["sites"]
        except FederationRefused:
            return False
        return all(sites[s]["online"] for s in SITES)

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")[-3000:]

    def run_dir(self, job: str) -> Path:
        return self.root / "jobs" / job / "run"

    def server_audit(self) -> list[dict[str, Any]]:
        return AuditLog(self.root / "jobs" / "audit.jsonl").records()

    def site_audit(self, site: str) -> list[dict[str, Any]]:
        return AuditLog(self.root / f"work-{site}" / "audit.jsonl").records()


def write_csv(path: Path, x: np.ndarray, y: np.ndarray) -> None:
    header = ",".join([*(f"f{j}" for j in range(x.shape[1])), "label"])
    rows = [",".join([*(f"{v:g}" for v in xi), str(int(yi))]) for xi, yi in zip(x, y)]
    path.write_text("\n".join([header, *rows]) + "\n")


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Federation]:
    from sklearn.datasets import load_digits

    root = tmp_path_factory.mktemp("federation")
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    (root / "data").mkdir()
    for site, (a, b) in ROWS.items():
        write_csv(root / "data" / f"{site}.csv", x[a:b], y[a:b])
    write_csv(root / "data" / "test.csv", x[1500:1700], y[1500:1700])
    make_credentials(root / "certs", 0, site_names=SITES, admins=["ada"])
    address = f"127.0.0.1:{free_port()}"
    fed = yaml.safe_load((EXAMPLES / "FED.yaml").read_text()) | {"address": address, "offer_timeout": 60}
    fed_file = root / "FED.yaml"
    fed_file.write_text(yaml.safe_dump(fed))
    site_files = {}
    for site in SITES:
        data = yaml.safe_load((EXAMPLES / "SITE.yaml").read_text())
        data.update(name=site, server=address, workdir=f"work-{site}", policy=POLICIES[site],
                    poll_interval=0.3, backoff_max=1.0)
        data["catalog"]["digits"]["path"] = f"data/{site}.csv"
        site_files[site] = root / f"SITE-{site}.yaml"
        site_files[site].write_text(yaml.safe_dump(data))
    admin = Admin(AdminConfig(federation=address, credentials=str(root / "certs"), name="ada"))
    fedn = Federation(root, address, fed_file, site_files, admin, {}, root / "data" / "test.csv")
    fedn.start_server()
    for site, path in site_files.items():
        fedn.procs[site] = start(["federation", "join", str(path)], root / f"{site}.log")
    try:
        fedn.wait_for(fedn.all_online, "federation with its three sites online", 60)
        yield fedn
    finally:
        admin.close()
        for proc in fedn.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in fedn.procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)


def simulate(federation: Federation, job: dict[str, Any], sites: list[str], out: Path) -> runner.Run:
    """``fedweave run`` of ``job`` over the same per-site files, client i reading the i-th site's."""
    folder = out / "sim-data"
    folder.mkdir(parents=True, exist_ok=True)
    for i, site in enumerate(sites):
        (folder / f"site_{i}.csv").write_bytes((federation.root / "data" / f"{site}.csv").read_bytes())
    options = job["task"]["dataset_options"] | {"path": str(folder / "site_{client}.csv")}
    simulated = job | {"clients": len(sites), "task": job["task"] | {"dataset_options": options}}
    simulated.pop("grpc", None)
    # the sequential loop, as every site trains: a vectorised cohort rounds differently (docs/simulation.md)
    simulated["simulation"] = simulated.get("simulation", {}) | {"cohort": "off"}
    return runner.run_config(config_mod.from_dict(simulated), out / "reference")


def assert_equal_runs(federation: Federation, job: str, reference: runner.Run, rounds: int) -> None:
    records = rundir.records_until(federation.run_dir(job), "round", rounds)
    assert [r["round"] for r in records] == [r["round"] for r in reference.records]
    for a, b in zip(reference.records, records):
        for key in ("train_loss", "test_loss", "test_accuracy"):
            assert (a.get(key) is None) == (b.get(key) is None), key
            if a.get(key) is not None:
                assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), key
    model = rundir.load_model(federation.run_dir(job))
    assert model.keys() == reference.params.keys()
    for name, tensor in reference.params.items():
        torch.testing.assert_close(model[name], tensor, rtol=1e-6, atol=1e-7, msg=name)


def show(job: str, federation: Federation, capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    args = ["--federation", federation.address, "--credentials", str(federation.root / "certs"), "--name", "ada"]
    assert main(["job", job, *args]) == 0
    return capsys.readouterr().out


def ended(federation: Federation, job: str, record: dict[str, Any]) -> str:
    """Why ``job`` ended as it did: its state and reason first, then the end of its server's log."""
    return f"{job} {record['state']}: {record.get('reason')}\n{federation.admin.logs(job)[-3000:]}"


def test_two_jobs_back_to_back_complete_and_equal_fedweave_run(
    federation: Federation, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    first = federation.job(name="digits-a")
    second = federation.job(name="digits-b", seed=5, local={"epochs": 1, "batch_size": 8, "lr": 0.05})
    (tmp_path / "JOB.yaml").write_text(yaml.safe_dump(first))
    admin_file = tmp_path / "admin.yaml"  # what `fedweave submit` reads from $FEDWEAVE_ADMIN
    admin_file.write_text(yaml.safe_dump({"federation": federation.address, "name": "ada",
                                          "credentials": str(federation.root / "certs")}))
    monkeypatch.setenv("FEDWEAVE_ADMIN", str(admin_file))
    capsys.readouterr()
    assert main(["submit", str(tmp_path / "JOB.yaml")]) == 0
    ids = [capsys.readouterr().out.strip(), federation.admin.submit(second)]
    assert ids[0].startswith("job-")
    for job in ids:
        record = federation.wait(job)
        assert record["state"] == "finished", ended(federation, job, record)
        assert record["clients"] == {"alpha": 0, "beta": 1, "gamma": 2}
        assert record["rounds_done"] == 3
    for job, config in zip(ids, (first, second)):
        assert_equal_runs(federation, job, simulate(federation, config, list(SITES), tmp_path / job), 3)
    text = show(ids[1], federation, capsys)
    assert f"{ids[1]}  finished" in text and "rounds: 3 of 3" in text
    assert str(federation.run_dir(ids[1])) in text
    assert all(f"{site}" in text for site in SITES)
    events = [(r["event"], r["fields"].get("job")) for r in federation.server_audit()]
    assert ("submitted", ids[0]) in events and ("finished", ids[1]) in events
    for site in SITES:
        assert ("accepted", ids[1]) in [(r["event"], r["fields"].get("job")) for r in federation.site_audit(site)]


def events(records: list[dict[str, Any]], job: str) -> list[tuple[str, dict[str, Any]]]:
    return [(r["event"], r["fields"]) for r in records if r["fields"].get("job") == job]


def test_a_site_refuses_a_job_its_policy_forbids_and_it_runs_without_it_or_ends_refused(
    federation: Federation, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fedprox = federation.job(name="prox", strategy={"name": "fedprox", "mu": 0.01}, rounds=2)
    without = federation.admin.submit(fedprox)  # min_clients 2: alpha and beta are enough
    refused = federation.admin.submit(fedprox | {"min_clients": 3})
    record = federation.wait(without)
    assert record["state"] == "finished", ended(federation, without, record)
    assert record["clients"] == {"alpha": 0, "beta": 1}
    assert record["sites"]["gamma"]["state"] == "refused"
    assert record["sites"]["gamma"]["rule"] == "policy.strategies"
    assert_equal_runs(federation, without, simulate(federation, fedprox, ["alpha", "beta"], tmp_path), 2)
    record = federation.wait(refused)
    assert record["state"] == "refused"
    assert "fewer than min_clients=3" in record["reason"] and "gamma refused it (policy.strategies)" in record["reason"]
    assert not federation.run_dir(refused).exists()  # nothing of it ran
    for job, state in ((without, "finished"), (refused, "refused")):
        text = show(job, federation, capsys)
        assert f"{job}  {state}" in text
        gamma = next(line for line in text.splitlines() if line.strip().startswith("gamma"))
        assert "refused" in gamma and "policy.strategies" in gamma and "fedprox" in gamma
        server = events(federation.server_audit(), job)
        assert ("refused", {"job": job, "site": "gamma", "rule": "policy.strategies",
                            "reason": record["sites"]["gamma"]["reason"]}) in server
        site = [f for e, f in events(federation.site_audit("gamma"), job) if e == "refused"]
        assert site and site[0]["rule"] == "policy.strategies"
        assert ("accepted" in [e for e, _ in events(federation.site_audit("alpha"), job)])
    assert ("refused", refused) in [(e, f.get("job")) for e, f in events(federation.server_audit(), refused)
                                    if "site" not in f]


def test_a_site_certificate_cannot_submit_or_cancel_and_a_tampered_bundle_is_refused_by_every_site(
    federation: Federation, tmp_path: Path
) -> None:
    as_site = Admin(AdminConfig(federation=federation.address, credentials=str(federation.root / "certs"), name="alpha"),
                    role="site")
    with as_site:
        with pytest.raises(FederationRefused, match="PERMISSION_DENIED: Submit: site 'alpha' may not call it; "
                                                    "only an admin may submit"):
            as_site.submit(federation.job())
        with pytest.raises(FederationRefused, match="PERMISSION_DENIED: Cancel: site 'alpha' may not call it"):
            as_site.cancel("job-0001")
    denied = [r["fields"] for r in federation.server_audit() if r["event"] == "denied"]
    assert {d["method"] for d in denied if d["caller"] == "site-alpha"} >= {"Submit", "Cancel"}

    code = tmp_path / "code"
    code.mkdir()
    (code / "helpers.py").write_text("VALUE = 1\n")
    submitted = pack(code)
    (code / "helpers.py").write_text("VALUE = 2  # changed after the hash was taken\n")
    job = federation.admin.submit(federation.job(name="tampered", rounds=2), bundle=(pack(code), digest(submitted)))
    record = federation.wait(job)
    assert record["state"] == "refused"
    assert record["bundle_sha256"] == digest(submitted)
    for site in ("alpha", "beta"):  # they allow bundles: the hash check refuses this one
        assert record["sites"][site]["state"] == "refused" and record["sites"][site]["rule"] == "bundle"
        assert f"is not the submitted {digest(submitted)}" in record["sites"][site]["reason"]
        assert [f["rule"] for e, f in events(federation.site_audit(site), job) if e == "refused"] == ["bundle"]
        assert not (federation.root / f"work-{site}" / job / "code").exists()  # nothing unpacked
    assert record["sites"]["gamma"]["rule"] == "policy.code"  # gamma takes no bundle at all
    assert record["clients"] == {}


def test_kill_9_of_the_federation_mid_job_resumes_it_from_its_checkpoint_and_keeps_the_queue(
    federation: Federation, tmp_path: Path
) -> None:
    long = federation.job(name="survivor", rounds=30, local={"epochs": 1, "batch_size": 4, "lr": 0.05})
    job = federation.admin.submit(long)
    queued = federation.admin.submit(federation.job(name="after", rounds=2))
    metrics = federation.run_dir(job) / "metrics.jsonl"
    federation.wait_for(lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= 1, "first round", 120)
    server = federation.procs["server"]
    os.kill(server.pid, signal.SIGKILL)  # the service alone; its job server dies with it
    server.wait(10)
    cut_at = len(metrics.read_text().splitlines())
    assert cut_at < 30
    assert json.loads((federation.root / "jobs" / queued / "job.json").read_text())["state"] == "queued"
    federation.start_server()
    federation.wait_for(federation.all_online, "the sites back online", 60)  # they reconnect on their own
    record = federation.wait(job)
    assert record["state"] == "finished", ended(federation, job, record)
    assert record["clients"] == {"alpha": 0, "beta": 1, "gamma": 2}
    resumed = [f for e, f in events(federation.server_audit(), job) if e == "resumed"]
    assert len(resumed) == 1 and 1 <= resumed[0]["rounds_done"] < 30
    assert_equal_runs(federation, job, simulate(federation, long, list(SITES), tmp_path), 30)  # resume is exact
    for site in SITES:  # each site started its client again, at the new job server, on its own
        starts = [f["address"] for e, f in events(federation.site_audit(site), job) if e == "client_started"]
        assert len(set(starts)) == 2, starts
    record = federation.wait(queued)
    assert record["state"] == "finished", ended(federation, queued, record)  # the queue survived the restart


def test_cancel_stops_a_running_job_within_a_round_and_frees_its_sites(federation: Federation) -> None:
    long = federation.job(name="cancelled", rounds=300, local={"epochs": 1, "batch_size": 1, "lr": 0.02})
    job = federation.admin.submit(long)
    following = federation.admin.submit(federation.job(name="next", rounds=2))
    metrics = federation.run_dir(job) / "metrics.jsonl"
    federation.wait_for(lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= 2, "two rounds", 120)
    at_cancel = federation.admin.cancel(job)["rounds_done"]
    record = federation.wait(job)
    assert record["state"] == "cancelled" and record["reason"] == "cancelled by ada", ended(federation, job, record)
    assert 2 <= record["rounds_done"] <= at_cancel + 1
    nxt = federation.wait(following)
    assert nxt["state"] == "finished", ended(federation, following, nxt)
    assert nxt["clients"] == {"alpha": 0, "beta": 1, "gamma": 2}
    assert ("cancel", {"job": job, "by": "ada", "state": "running"}) in events(federation.server_audit(), job)
    for site in SITES:
        assert "client_ended" in [e for e, _ in events(federation.site_audit(site), job)]
    with pytest.raises(FederationRefused, match="is cancelled already"):
        federation.admin.cancel(job)
