"""The federation service's deployment forms: ``fedweave deploy federation`` (Kubernetes: a Deployment-managed
server on its job store's claim, a Deployment per site) and deploy/slurm/federation-sites.sbatch (sites
joining an external federation from a Slurm allocation's nodes)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from fedweave.cli.parser import build_parser
from fedweave.deploy.kubernetes import KUBERNETES_VERSION
from fedweave.deploy.kubernetes import federation as fed_mod
from fedweave.errors import ConfigError

from .conftest import ROOT, by_kind, kustomize

SITES_SCRIPT = ROOT / "deploy" / "slurm" / "federation-sites.sbatch"


def write(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    for node, names in (("server", ["ca.pem", "server.pem", "server.key", "ca.key", "admin-ann.key"]),
                        ("a", ["ca.pem", "site-lab-a.pem", "site-lab-a.key", "site-lab-b.key"]),
                        ("b", ["ca.pem", "site-lab-b.pem", "site-lab-b.key"])):
        for name in names:
            write(tmp_path / "creds" / node / name, f"{node} {name}\n")
    fed = write(tmp_path / "fed.yaml", {"name": "Hospitals", "listen": "0.0.0.0:7000", "store": "store",
                                        "credentials": "creds/server", "max_concurrent_jobs": 2,
                                        "job_ports": "7400-7402", "job_host": "127.0.0.1"})
    a = write(tmp_path / "a.yaml", {
        "name": "lab-a", "server": "fed.example.org:7443", "credentials": "creds/a", "device": "cpu",
        "catalog": {"cardiology": {"path": "data/cardio.csv", "format": "csv", "label": "outcome"}},
        "policy": {"strategies": ["fedavg"]},
    })
    b = write(tmp_path / "b.yaml", {
        "name": "lab-b", "server": "fed.example.org:7443", "credentials": "creds/b", "device": "cuda",
        "catalog": {"scans": {"path": "/srv/lab-b/scans", "format": "imagefolder"}},
    })
    return {"fed": fed, "a": a, "b": b}


def options(**site_data: str) -> fed_mod.FederationOptions:
    return fed_mod.FederationOptions(
        fed_mod.Options(namespace="fl"), {s: fed_mod.SiteData.parse(f"{s}={v}")[1] for s, v in site_data.items()}
    )


def built(rendered, folder: str = "base") -> list[dict[str, Any]]:
    (kustomization,) = [k for k in rendered.kustomizations if k.parent.name == folder]
    objects = kustomize(kustomization.parent)
    for obj in objects:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    return objects


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (body,) = deployment["spec"]["template"]["spec"]["containers"]
    return body


def test_the_service_renders_builds_and_validates(files: dict[str, Path], tmp_path: Path):
    out = tmp_path / "out"
    rendered = fed_mod.render(files["fed"], [files["a"], files["b"]], out, options(**{"lab-b": "host:/srv/lab-b"}))
    assert rendered.name == "hospitals"
    objects = built(rendered)
    assert {o["kind"] for o in built(rendered, "namespace")} == {o["kind"] for o in objects} | {"Namespace"}
    deployments = by_kind(objects, "Deployment")
    assert set(deployments) == {"hospitals-server", "hospitals-site-lab-a", "hospitals-site-lab-b"}
    for deployment in deployments.values():
        assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
        pod = deployment["spec"]["template"]["spec"]
        assert pod["restartPolicy"] == "Always" and pod["securityContext"]["runAsNonRoot"] is True

    server = deployments["hospitals-server"]
    body = container(server)
    assert body["args"] == ["federation", "serve", "/etc/fedweave/federation.yaml"]
    assert body["readinessProbe"]["grpc"] == {"port": 8081} and body["livenessProbe"]["grpc"] == {"port": 8081}
    assert {p["name"]: p["containerPort"] for p in body["ports"]} == {
        "grpc": 7000, "health": 8081, "job-7400": 7400, "job-7401": 7401, "job-7402": 7402}
    volumes = {v["name"]: v for v in server["spec"]["template"]["spec"]["volumes"]}
    assert volumes["store"]["persistentVolumeClaim"]["claimName"] == "hospitals-store"
    assert volumes["credentials"]["secret"]["secretName"] == "hospitals-server"
    mounts = {m["name"]: m for m in body["volumeMounts"]}
    assert mounts["config"] == {"name": "config", "mountPath": "/etc/fedweave/federation.yaml",
                                "subPath": "federation.yaml", "readOnly": True}
    assert mounts["store"]["mountPath"] == "/var/lib/fedweave"
    claims = by_kind(objects, "PersistentVolumeClaim")
    assert claims["hospitals-store"]["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert set(claims) == {"hospitals-store", "hospitals-site-lab-a-work", "hospitals-site-lab-a-data",
                           "hospitals-site-lab-b-work"}
    service_ports = by_kind(objects, "Service")["hospitals-server"]["spec"]["ports"]
    assert [(p["name"], p["port"], p["targetPort"]) for p in service_ports] == [
        ("grpc", 7000, "grpc"), ("job-7400", 7400, "job-7400"), ("job-7401", 7401, "job-7401"),
        ("job-7402", 7402, "job-7402")]

    served = yaml.safe_load(by_kind(objects, "ConfigMap")["hospitals-federation"]["data"]["federation.yaml"])
    assert served == {"name": "Hospitals", "listen": "0.0.0.0:7000", "store": "/var/lib/fedweave/store",
                      "credentials": "/etc/fedweave/credentials", "max_concurrent_jobs": 2,
                      "job_ports": "7400-7402", "job_host": "hospitals-server",  # the sites dial the Service
                      "health_listen": "0.0.0.0:8081"}

    site_a = deployments["hospitals-site-lab-a"]
    body = container(site_a)
    assert body["args"] == ["federation", "join", "/etc/fedweave/site.yaml"]
    volumes = {v["name"]: v for v in site_a["spec"]["template"]["spec"]["volumes"]}
    assert volumes["data"]["persistentVolumeClaim"] == {"claimName": "hospitals-site-lab-a-data", "readOnly": True}
    assert volumes["credentials"]["secret"]["secretName"] == "hospitals-site-lab-a"
    assert {m["name"]: m.get("readOnly", False) for m in body["volumeMounts"]}["data"] is True
    joined = yaml.safe_load(by_kind(objects, "ConfigMap")["hospitals-site-lab-a"]["data"]["site.yaml"])
    assert joined["server"] == "hospitals-server:7000" and joined["workdir"] == "/var/lib/fedweave/work"
    assert joined["catalog"]["cardiology"]["path"] == "/var/lib/fedweave/data/data/cardio.csv"
    assert joined["policy"] == {"strategies": ["fedavg"]}

    site_b = deployments["hospitals-site-lab-b"]
    volumes = {v["name"]: v for v in site_b["spec"]["template"]["spec"]["volumes"]}
    assert volumes["data"]["hostPath"] == {"path": "/srv/lab-b", "type": "Directory"}
    assert container(site_b)["resources"]["limits"]["nvidia.com/gpu"] == 1  # device: cuda
    joined = yaml.safe_load(by_kind(objects, "ConfigMap")["hospitals-site-lab-b"]["data"]["site.yaml"])
    assert joined["catalog"]["scans"]["path"] == "/var/lib/fedweave/data/scans"
    assert any("hostPath" in note for note in rendered.notes)

    policies = by_kind(objects, "NetworkPolicy")
    jobs = [{"port": p, "protocol": "TCP"} for p in (7400, 7401, 7402)]
    federation_port, from_sites = policies["hospitals-server"]["spec"]["ingress"]
    assert federation_port == {"ports": [{"port": 7000, "protocol": "TCP"}]}  # sites and admins, anywhere
    assert from_sites["ports"] == jobs  # the jobs' servers: from the sites' pods only
    assert from_sites["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "site"
    for site in ("lab-a", "lab-b"):
        site_policy = policies[f"hospitals-site-{site}"]["spec"]
        assert site_policy["ingress"] == [] and site_policy["egress"][1]["to"][0]["podSelector"]["matchLabels"][
            "app.kubernetes.io/component"] == "server"
        assert site_policy["egress"][1]["ports"] == [{"port": 7000, "protocol": "TCP"}, *jobs]
    secrets = by_kind(objects, "Secret")
    assert set(secrets["hospitals-site-lab-a"]["data"]) == {"ca.pem", "site-lab-a.pem", "site-lab-a.key"}
    assert (out / "base" / "credentials" / "site-lab-a" / "site-lab-a.key").stat().st_mode & 0o077 == 0


def test_sites_of_an_external_federation(files: dict[str, Path], tmp_path: Path):
    rendered = fed_mod.render(None, [files["a"]], tmp_path / "out", options(**{"lab-a": "claim:lab-a-data"}))
    objects = built(rendered)
    assert set(by_kind(objects, "Deployment")) == {"federation-site-lab-a"}
    joined = yaml.safe_load(by_kind(objects, "ConfigMap")["federation-site-lab-a"]["data"]["site.yaml"])
    assert joined["server"] == "fed.example.org:7443"
    egress = by_kind(objects, "NetworkPolicy")["federation-site-lab-a"]["spec"]["egress"]
    assert egress[1] == {"ports": [{"port": 7443, "protocol": "TCP"}]}  # the external server, any host
    jobs = fed_mod.FederationOptions(job_ports="7500-7501")  # the external federation's jobs' servers
    reaching = built(fed_mod.render(None, [files["a"]], tmp_path / "jobs", jobs))
    egress = by_kind(reaching, "NetworkPolicy")["federation-site-lab-a"]["spec"]["egress"]
    assert egress[1] == {"ports": [{"port": p, "protocol": "TCP"} for p in (7443, 7500, 7501)]}
    with pytest.raises(ConfigError, match="--job-ports: expected LOW-HIGH"):
        fed_mod.render(None, [files["a"]], tmp_path / "jobs", fed_mod.FederationOptions(job_ports="7500"))
    with pytest.raises(ConfigError, match="--job-ports is for sites of an external federation"):
        fed_mod.render(files["fed"], [files["a"]], tmp_path / "jobs", jobs)
    assert set(by_kind(objects, "PersistentVolumeClaim")) == {"federation-site-lab-a-work"}  # the named data claim
    volumes = by_kind(objects, "Deployment")["federation-site-lab-a"]["spec"]["template"]["spec"]["volumes"]
    assert {v["name"]: v for v in volumes}["data"]["persistentVolumeClaim"]["claimName"] == "lab-a-data"


def test_credentials_are_never_replaced_without_force(files: dict[str, Path], tmp_path: Path):
    out = tmp_path / "out"
    fed_mod.render(files["fed"], [], out)
    fed_mod.render(files["fed"], [], out)  # the same files: nothing to replace
    (tmp_path / "creds" / "server" / "server.key").write_text("a new key\n")
    with pytest.raises(ConfigError, match="differs .*pass --force"):
        fed_mod.render(files["fed"], [], out)
    assert (out / "base" / "credentials" / "server" / "server.key").read_text() == "server server.key\n"
    fed_mod.render(files["fed"], [], out, fed_mod.FederationOptions(force=True))
    assert (out / "base" / "credentials" / "server" / "server.key").read_text() == "a new key\n"


def test_errors_name_the_key(files: dict[str, Path], tmp_path: Path):
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match="catalog.scans.path': /srv/lab-b/scans is absolute"):
        fed_mod.render(None, [files["b"]], out)
    with pytest.raises(ConfigError, match="nothing to deploy"):
        fed_mod.render(None, [], out)
    with pytest.raises(ConfigError, match="is not SITE=claim:NAME or SITE=host:/PATH"):
        fed_mod.SiteData.parse("lab-a=/srv")
    write(tmp_path / "c.yaml", {"name": "lab-c", "server": "x:1", "credentials": "creds/none"})
    with pytest.raises(ConfigError, match="config key 'credentials': no folder"):
        fed_mod.render(None, [tmp_path / "c.yaml"], out)
    write(tmp_path / "d.yaml", {"name": "lab-a", "server": "x:1", "credentials": "creds/a"})
    with pytest.raises(ConfigError, match="config key 'name': 'lab-a' gives the same object names"):
        fed_mod.render(None, [files["a"], tmp_path / "d.yaml"], out)
    write(tmp_path / "e.yaml", {"name": "lab-e", "credentials": "creds/a", "catalog": {"x": {"path": "../up.csv"}}})
    with pytest.raises(ConfigError, match="catalog.x.path': ../up.csv leaves the data volume"):
        fed_mod.render(files["fed"], [tmp_path / "e.yaml"], out)
    write(tmp_path / "f.yaml", {"name": "f", "listen": "0.0.0.0:7000", "health_listen": ":7000", "credentials": "creds/server"})
    with pytest.raises(ConfigError, match="health_listen': port 7000 is the federation's"):
        fed_mod.render(tmp_path / "f.yaml", [], out)
    fed = yaml.safe_load(files["fed"].read_text())
    for change, message in (
        ({"job_ports": None}, "config key 'job_ports' is required on Kubernetes"),
        ({"job_ports": "7400-7400"}, "config key 'job_ports': 7400-7400 has 1 ports, fewer than max_concurrent_jobs=2"),
        ({"job_ports": "8080-8090"}, "config key 'job_ports': 8080-8090 holds port 8081"),
        ({"job_ports": "74OO-7402"}, "config key 'job_ports': expected LOW-HIGH"),
    ):
        write(tmp_path / "g.yaml", fed | change)
        with pytest.raises(ConfigError, match=message):
            fed_mod.render(tmp_path / "g.yaml", [], out)


def test_a_node_secret_holds_its_own_key_pair_and_the_ca_certificate_only(files: dict[str, Path], tmp_path: Path):
    """A credentials folder of `fedweave certs` also holds the CA's key and every other node's key: none travels."""
    fed_mod.render(str(files["fed"]), [str(files["a"])], tmp_path / "out", options())
    folder = tmp_path / "out" / "base" / "credentials"
    assert sorted(p.name for p in (folder / "server").iterdir()) == ["ca.pem", "server.key", "server.pem"]
    assert sorted(p.name for p in (folder / "site-lab-a").iterdir()) == ["ca.pem", "site-lab-a.key", "site-lab-a.pem"]
    (tmp_path / "creds" / "b" / "site-lab-b.key").unlink()
    with pytest.raises(ConfigError, match=r"credentials': no file 'site-lab-b.key'"):
        fed_mod.render(str(files["fed"]), [str(files["b"])], tmp_path / "out2", options(**{"lab-b": "host:/srv/lab-b"}))


def test_the_cli_names_the_target(files: dict[str, Path], tmp_path: Path):
    args = build_parser().parse_args(["deploy", "federation", str(files["fed"]), "--site", str(files["a"]),
                                      "--site-data", "lab-a=claim:data-a", "--out", str(tmp_path / "out")])
    rendered = fed_mod.render_args(args)
    assert [p.parent.name for p in rendered.kustomizations] == ["base"]
    assert (tmp_path / "out" / "base" / "site-lab-a.yaml").is_file()


def test_the_command_line_renders_the_federation(files: dict[str, Path], tmp_path: Path, capsys):
    from fedweave.cli import main

    out = tmp_path / "cli"
    rc = main(["deploy", "federation", str(files["fed"]), "--site", str(files["a"]),
               "--site-data", "lab-a=claim:data-a", "--out", str(out)])
    assert rc == 0
    assert (out / "base" / "site-lab-a.yaml").is_file()
    assert str(out / "base") in capsys.readouterr().out


def test_the_slurm_script_joins_each_site_from_a_node_of_its_own(files: dict[str, Path], tmp_path: Path):
    assert subprocess.run(["bash", "-n", str(SITES_SCRIPT)], check=False).returncode == 0
    text = SITES_SCRIPT.read_text()
    assert "$FEDWEAVE federation join \"$site\"" in text
    bin_dir = tmp_path / "bin"
    calls = tmp_path / "calls"
    write(bin_dir / "scontrol", "#!/bin/bash\nprintf 'node1\\nnode2\\n'\n")
    write(bin_dir / "srun", f"#!/bin/bash\necho \"$*\" >> {calls}\n")
    for tool in ("scontrol", "srun"):
        (bin_dir / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node[1-2]"}
    done = subprocess.run(["bash", str(SITES_SCRIPT), str(files["a"]), str(files["b"])], env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    lines = sorted(calls.read_text().splitlines())
    assert len(lines) == 2
    for line, node, site in zip(lines, ("node1", "node2"), (files["a"], files["b"])):
        assert f"--nodelist={node}" in line and line.endswith(f"fedweave federation join {site}")
    too_many = subprocess.run(["bash", str(SITES_SCRIPT), str(files["a"]), str(files["b"]), str(files["a"])],
                              env=env, capture_output=True, text=True, timeout=60, check=False)
    assert too_many.returncode == 2 and "3 site files need 3 nodes" in too_many.stderr
