"""``fedweave deploy k8s``: every overlay of every deployment shape builds with ``kubectl kustomize``,
passes ``kubernetes-validate --strict`` for the Kubernetes version the module names, the PyTorchJob
validates against the vendored schema of its CRD, and the objects say what docs/deployment.md says."""

from __future__ import annotations

import base64
import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from cryptography import x509

from fedweave import cli
from fedweave import config as config_mod
from fedweave.deploy import kubernetes as k8s
from fedweave.errors import ConfigError

from .conftest import EXAMPLES, ROOT, by_kind, kustomize

SCHEMA = json.loads((Path(__file__).parent / "schemas" / "pytorchjob-kubeflow.org-v1.json").read_text())
STAR = EXAMPLES / "digits-grpc.yaml"
HIERARCHICAL = EXAMPLES / "digits-hierarchical.yaml"
DATA_PARALLEL = EXAMPLES / "data-parallel-mnist5k.yaml"


def validate(obj: dict[str, Any]) -> None:
    """Strict schema of the named Kubernetes version; a PyTorchJob against its CRD, its pod template as one."""
    if obj["kind"] == "PyTorchJob":
        jsonschema.validate(obj, SCHEMA)
        for replica in obj["spec"]["pytorchReplicaSpecs"].values():
            template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": replica["template"]}
            kubernetes_validate.validate(template, k8s.KUBERNETES_VERSION, strict=True)
        return
    kubernetes_validate.validate(obj, k8s.KUBERNETES_VERSION, strict=True)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, k8s.Rendered]:
    out = tmp_path_factory.mktemp("k8s")
    return {
        "star": k8s.render(STAR, out / "star", k8s.Options(image="registry.example/fedweave:0.1.0")),
        "hierarchical": k8s.render(HIERARCHICAL, out / "hier", k8s.Options(namespace="federation")),
        "data_parallel": k8s.render(DATA_PARALLEL, out / "dp"),
    }


def test_every_overlay_builds_and_validates_strictly(rendered: dict[str, k8s.Rendered]) -> None:
    built = {}
    for shape, r in rendered.items():
        for kustomization in r.kustomizations:
            objects = kustomize(kustomization.parent)
            assert objects
            for obj in objects:
                validate(obj)
            built[(shape, kustomization.parent.name)] = {o["kind"] for o in objects}
    assert set(built) == {
        ("star", "base"), ("star", "gpu"), ("hierarchical", "base"), ("hierarchical", "gpu"),
        ("data_parallel", "base"), ("data_parallel", "gpu"), ("data_parallel", "pytorchjob"),
    }
    assert built["star", "base"] == {
        "ConfigMap", "Secret", "PersistentVolumeClaim", "Service", "NetworkPolicy", "Job",
    }
    assert built["hierarchical", "base"] == built["star", "base"] | {"Namespace"}
    assert built["data_parallel", "base"] == {"ConfigMap", "PersistentVolumeClaim", "Service", "Job"}
    assert built["data_parallel", "pytorchjob"] == {"ConfigMap", "PersistentVolumeClaim", "PyTorchJob"}


def test_strict_validation_and_the_crd_schema_refuse_a_wrong_field(rendered: dict[str, k8s.Rendered]) -> None:
    """The checks are live: one unknown field, one value outside an enum, each fails."""
    server = by_kind(kustomize(rendered["star"].out / "base"), "Job")[f"{rendered['star'].name}-server"]
    bad = copy.deepcopy(server)
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["prot"] = 8081
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(bad)
    job = next(iter(by_kind(kustomize(rendered["data_parallel"].out / "overlays" / "pytorchjob"), "PyTorchJob").values()))
    for path, value in ((("spec", "elasticPolicy", "rdzvBackend"), "zmq"), (("spec", "pytorchReplicaSpecs", "Chief"), {})):
        bad = copy.deepcopy(job)
        parent = bad
        for key in path[:-1]:
            parent = parent[key]
        parent[path[-1]] = value
        with pytest.raises(jsonschema.ValidationError):
            validate(bad)


def test_the_star_deployment(rendered: dict[str, k8s.Rendered]) -> None:
    r = rendered["star"]
    objects = kustomize(r.out / "base")
    name = r.name
    assert name == "digits-grpc"
    config = config_mod.from_dict(yaml.safe_load(by_kind(objects, "ConfigMap")[f"{name}-config"]["data"]["config.yaml"]))
    g = config.grpc
    assert (g.tls, g.tokens, g.credentials) == ("mtls", True, k8s.CREDENTIALS_DIR)
    assert (g.address, g.listen, g.health_listen) == (f"{name}-server:50051", "0.0.0.0:50051", "0.0.0.0:8081")
    assert config.rounds == 10 and config.clients == 3  # the user's settings are kept
    assert g.connect_timeout == k8s.CLIENT_PATIENCE  # the clients outwait a restarting server pod

    server = by_kind(objects, "Job")[f"{name}-server"]
    spec = server["spec"]
    assert "completions" not in spec and "parallelism" not in spec  # one pod
    assert spec["podReplacementPolicy"] == "Failed"  # a new pod once the last one ended: one writer of the run
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "OnFailure"  # a crash restarts it (it resumes); a finished run completes
    (c,) = pod["containers"]
    assert c["image"] == "registry.example/fedweave:0.1.0"
    assert c["args"] == ["server", k8s.CONFIG_PATH, "--run-dir", k8s.RUN_DIR]
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"grpc": 50051, "health": 8081}
    assert c["readinessProbe"]["grpc"] == {"port": 8081} and c["livenessProbe"]["grpc"] == {"port": 8081}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["run"]["persistentVolumeClaim"]["claimName"] == f"{name}-run"
    assert {m["name"]: m["mountPath"] for m in c["volumeMounts"]}["run"] == k8s.DATA_DIR
    assert k8s.RUN_DIR.startswith(k8s.DATA_DIR + "/")
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == k8s.UID
    assert f"{name}-run" in by_kind(objects, "PersistentVolumeClaim")

    service = by_kind(objects, "Service")[f"{name}-server"]
    assert service["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "server"
    assert service["spec"]["ports"] == [{"name": "grpc", "port": 50051, "targetPort": "grpc", "protocol": "TCP"}]

    (policy,) = by_kind(objects, "NetworkPolicy").values()
    assert policy["spec"]["podSelector"]["matchLabels"] == service["spec"]["selector"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": 50051, "protocol": "TCP"}]
    (peer,) = rule["from"]
    assert peer["podSelector"]["matchExpressions"][0]["values"] == ["client", "site-leader"]

    jobs = by_kind(objects, "Job")
    assert sorted(jobs) == [*(f"{name}-client-{i}" for i in range(3)), f"{name}-server"]
    for i in range(3):
        job_pod = jobs[f"{name}-client-{i}"]["spec"]["template"]
        assert job_pod["metadata"]["labels"]["app.kubernetes.io/component"] == "client"  # admitted by the policy
        (jc,) = job_pod["spec"]["containers"]
        assert jc["args"] == ["client", k8s.CONFIG_PATH, "--id", str(i)]
        secret = {v["name"]: v for v in job_pod["spec"]["volumes"]}["credentials"]["secret"]["secretName"]
        assert secret == f"{name}-client-{i}"


def test_each_pod_holds_only_its_own_credentials_and_no_secret_holds_the_ca_key(
    rendered: dict[str, k8s.Rendered],
) -> None:
    objects = kustomize(rendered["star"].out / "base")
    secrets = by_kind(objects, "Secret")
    name = rendered["star"].name
    assert sorted(secrets[f"{name}-server"]["data"]) == ["ca.pem", "server.key", "server.pem", "tokens.json"]
    for i in range(3):
        assert sorted(secrets[f"{name}-client-{i}"]["data"]) == ["ca.pem", f"client-{i}.key", f"client-{i}.pem", f"client-{i}.token"]
    assert not any("ca.key" in s["data"] for s in secrets.values())
    creds = rendered["star"].out / "base" / "credentials"
    assert base64.b64decode(secrets[f"{name}-client-1"]["data"]["client-1.token"]) == (creds / "client-1.token").read_bytes()
    cert = x509.load_pem_x509_certificate(base64.b64decode(secrets[f"{name}-server"]["data"]["server.pem"]))
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert {f"{name}-server", f"{name}-server.default.svc", "localhost"} <= set(names)
    assert (creds / ".gitignore").read_text().splitlines()[-1] == "*"


def test_the_hierarchical_deployment_has_a_group_of_pods_per_site(rendered: dict[str, k8s.Rendered]) -> None:
    r = rendered["hierarchical"]
    objects = kustomize(r.out / "base")
    assert {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"} == {"federation"}
    config = config_mod.from_dict(yaml.safe_load(by_kind(objects, "ConfigMap")[f"{r.name}-config"]["data"]["config.yaml"]))
    assert config.topology.inner == "torchdist" and config.transport.kind == "grpc"
    jobs = by_kind(objects, "Job")
    services = by_kind(objects, "Service")
    # sites [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]: two top-level sites of four members each
    for s in range(2):
        site = f"{r.name}-site-{s}"
        port = 29500 + s
        leader = jobs[f"{site}-leader"]["spec"]["template"]["spec"]
        assert leader["containers"][0]["args"] == [
            "site", k8s.CONFIG_PATH, "--site", str(s), "--rank", "0", "--port", str(port), f"torchdist.address={site}",
        ]
        assert {v["name"]: v for v in leader["volumes"]}["credentials"]["secret"]["secretName"] == site
        assert services[site]["spec"]["clusterIP"] == "None"
        assert services[site]["spec"]["selector"] == jobs[f"{site}-leader"]["spec"]["template"]["metadata"]["labels"]
        for rank in range(1, 5):
            member = jobs[f"{site}-member-{rank}"]["spec"]["template"]["spec"]
            assert member["containers"][0]["args"][5:] == [str(rank), "--port", str(port), f"torchdist.address={site}"]
            assert "credentials" not in {v["name"] for v in member["volumes"]}  # members never talk to the server
    assert len(jobs) == 2 * 5 + 1  # and the server
    assert sorted(by_kind(objects, "Secret")) == [f"{r.name}-server", f"{r.name}-site-0", f"{r.name}-site-1"]


def test_data_parallel_torchrun_pods_and_the_pytorchjob(rendered: dict[str, k8s.Rendered]) -> None:
    r = rendered["data_parallel"]
    workers = config_mod.load(DATA_PARALLEL).data_parallel.workers
    objects = kustomize(r.out / "base")
    n = f"{r.name}-workers"
    job = by_kind(objects, "Job")[n]
    assert (job["spec"]["completions"], job["spec"]["parallelism"], job["spec"]["completionMode"]) == (workers, workers, "Indexed")
    pod = job["spec"]["template"]["spec"]
    assert pod["subdomain"] == n and by_kind(objects, "Service")[n]["spec"]["clusterIP"] == "None"
    (c,) = pod["containers"]
    assert c["command"] == ["torchrun"]
    assert c["args"] == [
        f"--nnodes={workers}", "--nproc-per-node=1", "--node-rank=$(JOB_COMPLETION_INDEX)",
        f"--master-addr={n}-0.{n}", "--master-port=29500", "-m", "fedweave.data_parallel", k8s.CONFIG_PATH,
        "--run-dir", k8s.RUN_DIR,
    ]
    claim = by_kind(objects, "PersistentVolumeClaim")[f"{r.name}-run"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # every worker pod, on any node, sees the run directory
    assert {"name": "run", "mountPath": k8s.DATA_DIR} in c["volumeMounts"]
    assert {"name": "run", "persistentVolumeClaim": {"claimName": f"{r.name}-run"}} in pod["volumes"]
    assert {"name": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "value": "1"} in c["env"]
    (pj,) = by_kind(kustomize(r.out / "overlays" / "pytorchjob"), "PyTorchJob").values()
    assert pj["spec"]["elasticPolicy"]["maxReplicas"] == workers
    worker = pj["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert worker["replicas"] == workers
    (pc,) = worker["template"]["spec"]["containers"]
    assert pc["name"] == "pytorch" and pc["command"] == ["torchrun"]
    assert pc["args"] == ["-m", "fedweave.data_parallel", k8s.CONFIG_PATH, "--run-dir", k8s.RUN_DIR]
    assert {"name": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "value": "1"} in pc["env"]  # elastic joins
    assert {"name": "run", "persistentVolumeClaim": {"claimName": f"{r.name}-run"}} in worker["template"]["spec"]["volumes"]


def test_the_gpu_overlay_gives_each_training_pod_a_gpu_and_the_cuda_image(rendered: dict[str, k8s.Rendered]) -> None:
    objects = kustomize(rendered["star"].out / "overlays" / "gpu")
    jobs = by_kind(objects, "Job")
    server = jobs.pop(f"{rendered['star'].name}-server")
    for job in jobs.values():
        (c,) = job["spec"]["template"]["spec"]["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert c["image"] == "registry.example/fedweave:0.1.0-cuda"
    assert "nvidia.com/gpu" not in server["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]


def test_rendering_again_keeps_the_keys_and_a_missing_file_is_one_clear_error(tmp_path: Path) -> None:
    first = k8s.render(STAR, tmp_path)
    creds = tmp_path / "base" / "credentials"
    ca = (creds / "ca.pem").read_bytes()
    k8s.render(STAR, tmp_path, k8s.Options(overrides=("rounds=3",)))
    assert (creds / "ca.pem").read_bytes() == ca
    assert config_mod.from_dict(yaml.safe_load((tmp_path / "base" / "config.yaml").read_text())).rounds == 3
    with pytest.raises(ConfigError, match="lacks client-3.key, client-3.pem, client-3.token"):
        k8s.render(STAR, tmp_path, k8s.Options(overrides=("clients=4",)))
    assert first.kustomizations[0] == tmp_path / "base" / "kustomization.yaml"


def test_a_deployment_needs_a_network_transport_and_keeps_the_commands_tls_choice(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="transport"):
        k8s.render(STAR, tmp_path, k8s.Options(overrides=("transport=inmemory",)))
    k8s.render(STAR, tmp_path, k8s.Options(overrides=("grpc.tls=tls",)))
    assert config_mod.from_dict(yaml.safe_load((tmp_path / "base" / "config.yaml").read_text())).grpc.tls == "tls"


@pytest.mark.parametrize(
    "options, flag",
    [
        (k8s.Options(cpu="two"), "--cpu"),
        (k8s.Options(memory="2 GB"), "--memory"),
        (k8s.Options(storage="-1Gi"), "--storage"),
        (k8s.Options(namespace="My_NS"), "--namespace"),
        (k8s.Options(image="fedweave 0.1"), "--image"),
    ],
)
def test_bad_options_are_one_line_naming_the_flag(tmp_path: Path, options: k8s.Options, flag: str) -> None:
    with pytest.raises(ConfigError, match=f"^fedweave deploy k8s: {flag} ") as err:
        k8s.render(STAR, tmp_path, options)
    assert "\n" not in str(err.value)
    assert not any(tmp_path.iterdir())  # nothing written


def test_k8s_names() -> None:
    assert k8s.k8s_name("Digits_FedProx v2!") == "digits-fedprox-v2"
    assert k8s.k8s_name("___") == "fedweave"
    assert len(k8s.k8s_name("x" * 100)) == 36


def test_the_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert cli.main(["deploy", "k8s", str(STAR), "--out", str(out), "rounds=4", "--namespace", "fl"]) == 0
    printed = capsys.readouterr().out
    assert str(out / "base") in printed and str(out / "overlays" / "gpu") in printed
    assert yaml.safe_load((out / "base" / "kustomization.yaml").read_text())["namespace"] == "fl"
    assert cli.main(["deploy", "k8s", str(tmp_path / "nope.yaml"), "--out", str(out)]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_the_cli_starts_without_torch() -> None:
    """``fedweave --help`` stays fast: registering ``deploy`` imports no torch."""
    code = "import sys, fedweave.cli.parser; fedweave.cli.parser.build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


def test_the_checked_in_deploy_k8s_is_a_fresh_render_of_the_grpc_example(tmp_path: Path) -> None:
    k8s.render(STAR, tmp_path)
    checked_in = ROOT / "deploy" / "k8s"
    fresh = {p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file() and "credentials" not in p.parts}
    kept = {p.relative_to(checked_in) for p in checked_in.rglob("*") if p.is_file() and "credentials" not in p.parts}
    assert kept - {Path("README.md")} == fresh
    for path in fresh:
        assert (checked_in / path).read_text() == (tmp_path / path).read_text(), path


def test_the_clients_patience_with_a_restarting_server_is_the_configs_when_it_sets_one(tmp_path: Path) -> None:
    data = yaml.safe_load(STAR.read_text())
    data["grpc"]["connect_timeout"] = 30
    (tmp_path / "own.yaml").write_text(yaml.safe_dump(data))
    k8s.render(tmp_path / "own.yaml", tmp_path / "own")
    assert config_mod.from_dict(yaml.safe_load((tmp_path / "own" / "base" / "config.yaml").read_text())).grpc.connect_timeout == 30
    k8s.render(STAR, tmp_path / "star", k8s.Options(overrides=("grpc.connect_timeout=45",)))
    assert config_mod.from_dict(yaml.safe_load((tmp_path / "star" / "base" / "config.yaml").read_text())).grpc.connect_timeout == 45
