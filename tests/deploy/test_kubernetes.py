"""``fedweave deploy k8s``: every overlay of every deployment shape builds with ``kubectl kustomize``,
passes ``kubernetes-validate --strict`` for the Kubernetes version the module names, the PyTorchJob
validates against the vendored schema of its CRD, and the objects say what docs/deployment.md says."""

from __future__ import annotations

import base64
import copy
import json
import subprocess
import sys
import types
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
from fedweave.deploy.kubernetes import manifests
from fedweave.errors import ConfigError

from .conftest import EXAMPLES, ROOT, by_kind, kustomize

SCHEMA = json.loads((Path(__file__).parent / "schemas" / "pytorchjob-kubeflow.org-v1.json").read_text())
STAR = EXAMPLES / "digits-grpc.yaml"
HIERARCHICAL = EXAMPLES / "digits-hierarchical.yaml"
DATA_PARALLEL = EXAMPLES / "data-parallel-mnist5k.yaml"


def pods(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The pod templates of the Jobs and PyTorchJobs among ``objects``."""
    templates = [o["spec"]["template"] for o in objects if o["kind"] == "Job"]
    for job in (o for o in objects if o["kind"] == "PyTorchJob"):
        templates += [r["template"] for r in job["spec"]["pytorchReplicaSpecs"].values()]
    return templates


def validate(obj: dict[str, Any]) -> None:
    """Strict schema of the named Kubernetes version; a PyTorchJob against its CRD, its pod template as one."""
    if obj["kind"] == "PyTorchJob":
        jsonschema.validate(obj, SCHEMA)
        for replica in obj["spec"]["pytorchReplicaSpecs"].values():
            template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": replica["template"]}
            kubernetes_validate.validate(template, k8s.KUBERNETES_VERSION, strict=True)
        return
    kubernetes_validate.validate(obj, k8s.KUBERNETES_VERSION, strict=True)


DIGEST = "registry.example/fedweave@sha256:" + "a" * 64
CUDA_DIGEST = "registry.example/fedweave-cuda@sha256:" + "b" * 64


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, k8s.Rendered]:
    out = tmp_path_factory.mktemp("k8s")
    return {
        "star": k8s.render(STAR, out / "star", k8s.Options(image="registry.example/fedweave:0.1.0")),
        "hierarchical": k8s.render(HIERARCHICAL, out / "hier", k8s.Options(namespace="federation")),
        "data_parallel": k8s.render(DATA_PARALLEL, out / "dp", k8s.Options(storage_class="nfs-client")),
        "metrics": k8s.render(STAR, out / "metrics", k8s.Options(
            namespace="fl", external_host="fl.example.org", overrides=("observe.prometheus_port=9100",),
        )),
        "cuda": k8s.render(DATA_PARALLEL, out / "cuda", k8s.Options(
            image=DIGEST, gpu_image=CUDA_DIGEST, overrides=("data_parallel.backend=nccl",),
        )),
    }


def validate_servicemonitor(obj: dict[str, Any], objects: list[dict[str, Any]]) -> None:
    """The Prometheus operator's ServiceMonitor (no CRD schema vendored): its selector picks the server's
    Service, which has the port it names."""
    assert obj["apiVersion"] == "monitoring.coreos.com/v1"
    services = [o for o in by_kind(objects, "Service").values()
                if obj["spec"]["selector"]["matchLabels"].items() <= o["metadata"]["labels"].items()]
    assert services and obj["spec"]["namespaceSelector"]["matchNames"] == [services[0]["metadata"]["namespace"]]
    (endpoint,) = obj["spec"]["endpoints"]
    assert any(endpoint["port"] in {p["name"] for p in s["spec"]["ports"]} for s in services)


def test_every_overlay_builds_and_validates_strictly(rendered: dict[str, k8s.Rendered]) -> None:
    built = {}
    for shape, r in rendered.items():
        for kustomization in r.kustomizations:
            objects = kustomize(kustomization.parent)
            assert objects
            for obj in objects:
                if obj["kind"] == "ServiceMonitor":
                    validate_servicemonitor(obj, objects)
                else:
                    validate(obj)
            built[(shape, kustomization.parent.name)] = {o["kind"] for o in objects}
    assert set(built) == {
        ("star", "base"), ("hierarchical", "base"), ("hierarchical", "namespace"),
        ("data_parallel", "base"), ("data_parallel", "pytorchjob"), ("metrics", "base"), ("metrics", "namespace"),
        ("metrics", "servicemonitor"), ("cuda", "base"), ("cuda", "pytorchjob"),
    }
    assert built["star", "base"] == {
        "ConfigMap", "Secret", "PersistentVolumeClaim", "Service", "NetworkPolicy", "Job",
    }
    assert built["hierarchical", "base"] == built["star", "base"]  # the base names the namespace, never creates it
    assert built["hierarchical", "namespace"] == built["star", "base"] | {"Namespace"}
    assert built["metrics", "servicemonitor"] == built["star", "base"] | {"ServiceMonitor"}
    assert built["data_parallel", "base"] == {"ConfigMap", "PersistentVolumeClaim", "Service", "Job", "NetworkPolicy"}
    assert built["data_parallel", "pytorchjob"] == {"ConfigMap", "PersistentVolumeClaim", "PyTorchJob", "NetworkPolicy"}


def test_every_pod_that_listens_on_no_port_has_a_startup_and_a_liveness_probe_of_its_file(
    rendered: dict[str, k8s.Rendered],
) -> None:
    """Issue 27: clients, site members and workers (torchrun Jobs and the PyTorchJob) touch the file
    FEDWEAVE_HEARTBEAT names; ``fedweave probe`` (the image's entry point, no shell) reads it, failing the pod
    once it is older than the config's grpc.heartbeat_timeout, after a startup probe of STARTUP_SECONDS."""
    seen = set()
    for shape in ("star", "hierarchical", "data_parallel", "cuda"):
        r = rendered[shape]
        timeout = config_mod.load(r.out / "base" / "config.yaml").grpc.heartbeat_timeout
        command = ["fedweave", "probe", "--heartbeat", "/tmp/fedweave-heartbeat", "--max-age", f"{timeout:g}"]
        for kustomization in r.kustomizations:
            for pod in pods(kustomize(kustomization.parent)):
                component = pod["metadata"]["labels"]["app.kubernetes.io/component"]
                (c,) = pod["spec"]["containers"]
                if component == "site-leader":  # it listens: its rendezvous port, once it has started
                    assert c["startupProbe"]["tcpSocket"] == c["livenessProbe"]["tcpSocket"] == {"port": "rendezvous"}
                if component not in ("client", "site-member", "worker"):
                    continue
                seen.add(component)
                assert {"name": "FEDWEAVE_HEARTBEAT", "value": "/tmp/fedweave-heartbeat"} in c["env"]
                assert c["livenessProbe"] == {"exec": {"command": command}, "periodSeconds": 10, "timeoutSeconds": 5,
                                              "failureThreshold": 3}
                assert c["startupProbe"] == {**c["livenessProbe"], "failureThreshold": 60}  # 10 minutes to start
    assert seen == {"client", "site-member", "worker"}


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

    policy = by_kind(objects, "NetworkPolicy")[f"{name}-server"]
    assert policy["spec"]["podSelector"]["matchLabels"] == service["spec"]["selector"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": 50051, "protocol": "TCP"}]
    (peer,) = rule["from"]
    assert peer["podSelector"]["matchExpressions"][0]["values"] == ["client", "site-leader"]
    ephemeral = {"requests": {"cpu": "1", "memory": "2Gi", "ephemeral-storage": "4Gi"}}
    assert c["resources"] == {**ephemeral, "limits": ephemeral["requests"]}
    assert {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}} in pod["volumes"]

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


def test_pods_whose_device_is_cuda_get_a_gpu_the_cuda_image_and_the_gpu_nodes(
    rendered: dict[str, k8s.Rendered],
) -> None:
    for overlay in ("base", "pytorchjob"):
        for pod in pods(kustomize(rendered["cuda"].out / ("base" if overlay == "base" else f"overlays/{overlay}"))):
            (c,) = pod["spec"]["containers"]
            assert c["image"] == CUDA_DIGEST  # the digest as given, not a tag made of it
            assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
            assert pod["spec"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
            assert pod["spec"]["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    for shape in ("star", "data_parallel", "hierarchical"):  # the CPU pods reserve no GPU
        for pod in pods(kustomize(rendered[shape].out / "base")):
            (c,) = pod["spec"]["containers"]
            assert "nvidia.com/gpu" not in c["resources"]["limits"] and "tolerations" not in pod["spec"]
            assert c["image"] == ("registry.example/fedweave:0.1.0" if shape == "star" else "fedweave:0.1.0")


def test_an_image_by_digest_is_kept_as_given_and_cuda_pods_then_need_their_own(tmp_path: Path) -> None:
    k8s.render(STAR, tmp_path / "star", k8s.Options(image=DIGEST))
    assert {c["image"] for pod in pods(kustomize(tmp_path / "star" / "base")) for c in pod["spec"]["containers"]} == {DIGEST}
    with pytest.raises(ConfigError, match=r"is a digest: name the image of the cuda pods with --gpu-image$"):
        k8s.render(DATA_PARALLEL, tmp_path / "dp", k8s.Options(image=DIGEST, overrides=("data_parallel.backend=nccl",)))
    k8s.render(DATA_PARALLEL, tmp_path / "tag", k8s.Options(image="reg.example:5000/fw:1.2", overrides=("data_parallel.backend=nccl",)))
    (pod,) = pods(kustomize(tmp_path / "tag" / "base"))
    assert pod["spec"]["containers"][0]["image"] == "reg.example:5000/fw:1.2-cuda"  # the Dockerfile's CUDA tag


def test_a_client_whose_local_device_is_cuda_gets_a_gpu(tmp_path: Path) -> None:
    """``local.device`` (read where the config has it): the clients train on the GPU, the server does not."""
    options = k8s.Options(image="fw:1")
    _, config, name = k8s.deployed_config(STAR, options)
    config.local = types.SimpleNamespace(**{**vars(config.local), "device": "cuda:0"})
    m = manifests.Manifests(config, name, options)
    (client, *_) = m.clients()
    (c,) = client["spec"]["template"]["spec"]["containers"]
    assert (c["image"], c["resources"]["limits"]["nvidia.com/gpu"]) == ("fw:1-cuda", 1)
    server = next(o for o in m.server() if o["kind"] == "Job")
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
        (k8s.Options(image="reg/fw@sha256:abc"), "--image"),
        (k8s.Options(gpu_image="Reg/FW"), "--gpu-image"),
        (k8s.Options(tmp_size="8Gi"), "--tmp-size"),
        (k8s.Options(storage_class="Fast_SSD"), "--storage-class"),
        (k8s.Options(external_host="fl example"), "--external-host"),
        (k8s.Options(resources={"gpu": {"cpu": "2"}}), "--cpu/--memory"),
        (k8s.Options(resources={"server": {"memory": "lots"}}), "--memory server="),
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
    assert k8s.k8s_name("x" * 36) == "x" * 36  # a name that fits is kept whole
    cut = k8s.k8s_name("x" * 37)
    assert cut[:29] == "x" * 29 and cut[29] == "-" and len(cut) == 36 and cut != k8s.k8s_name("x" * 38)


def test_two_configs_whose_names_differ_past_the_cut_render_disjoint_objects(tmp_path: Path) -> None:
    data = yaml.safe_load(STAR.read_text())
    names = {}
    for study in ("cardiology", "oncology"):
        data["name"] = f"federated-hospital-consortium-study-2026-{study}"
        (tmp_path / f"{study}.yaml").write_text(yaml.safe_dump(data))
        k8s.render(tmp_path / f"{study}.yaml", tmp_path / study)
        names[study] = {(o["kind"], o["metadata"]["name"]) for o in kustomize(tmp_path / study / "base")}
    assert len(names["cardiology"]) == len(names["oncology"]) > 10
    assert not names["cardiology"] & names["oncology"]


def test_the_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert cli.main(["deploy", "k8s", str(STAR), "--out", str(out), "rounds=4", "--namespace", "fl"]) == 0
    printed = capsys.readouterr().out
    assert str(out / "base") in printed and str(out / "overlays" / "namespace") in printed
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


# ---------------------------------------------------------------- NetworkPolicies, evaluated as a CNI does


def matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", []):
        assert expression["operator"] == "In"
        if labels.get(expression["key"]) not in expression["values"]:
            return False
    return True


Pod = tuple[str, dict[str, str]]  # namespace, labels
KUBE_DNS: Pod = ("kube-system", {"k8s-app": "kube-dns"})


def allows(objects: list[dict[str, Any]], source: Pod, target: Pod, port: int, protocol: str = "TCP") -> bool:
    """Whether the policies among ``objects`` let ``source`` open a connection to ``target``'s ``port``:
    the source's egress and the target's ingress (a pod no policy of a direction selects is open in it)."""
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]

    def side(pod: Pod, peer: Pod, direction: str) -> bool:
        selecting = [p for p in policies if p["metadata"]["namespace"] == pod[0] and direction in p["spec"]["policyTypes"]
                     and matches(p["spec"]["podSelector"], pod[1])]
        if not selecting:
            return True
        key, peers = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
        for policy in selecting:
            for rule in policy["spec"].get(key, []):
                if "ports" in rule and not any(r["port"] == port and r.get("protocol", "TCP") == protocol
                                               for r in rule["ports"]):
                    continue
                if peers not in rule:
                    return True
                for p in rule[peers]:
                    namespace_ok = (matches(p["namespaceSelector"], {"kubernetes.io/metadata.name": peer[0]})
                                    if "namespaceSelector" in p else peer[0] == pod[0])
                    if namespace_ok and matches(p.get("podSelector", {}), peer[1]):
                        return True
        return False

    return side(source, target, "Egress") and side(target, source, "Ingress")


def pods_of(objects: list[dict[str, Any]]) -> dict[str, Pod]:
    return {o["metadata"]["name"]: (o["metadata"]["namespace"], o["spec"]["template"]["metadata"]["labels"])
            for o in objects if o["kind"] == "Job"}


def test_every_pod_is_under_policies_that_admit_only_the_jobs_own_pods(rendered: dict[str, k8s.Rendered]) -> None:
    for shape, r in rendered.items():
        for kustomization in r.kustomizations:
            objects = kustomize(kustomization.parent)
            policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
            for pod in pods(objects):
                namespace = next(o for o in objects if o["kind"] in ("Job", "PyTorchJob"))["metadata"]["namespace"]
                labels = pod["metadata"]["labels"]
                for direction in ("Ingress", "Egress"):
                    assert any(direction in p["spec"]["policyTypes"] and matches(p["spec"]["podSelector"], labels)
                               for p in policies), (shape, labels, direction)
                stranger: Pod = (namespace, {**labels, "app.kubernetes.io/instance": "another-job"})
                for c in pod["spec"]["containers"]:
                    for p in c.get("ports", []):
                        if r.name == rendered["metrics"].name and p["name"] == "grpc" and shape == "metrics":
                            continue  # --external-host: the federation port is open to the clients outside
                        assert not allows(objects, stranger, (namespace, labels), p["containerPort"]), (shape, p)
                assert allows(objects, (namespace, labels), KUBE_DNS, 53, "UDP")  # every pod resolves names
                assert not allows(objects, (namespace, labels), ("default", {"app": "anything"}), 443)


def test_the_policies_admit_what_each_pod_needs(rendered: dict[str, k8s.Rendered]) -> None:
    star = kustomize(rendered["star"].out / "base")
    p = pods_of(star)
    server, client = p["digits-grpc-server"], p["digits-grpc-client-0"]
    assert allows(star, client, server, 50051)
    assert not allows(star, client, server, 8081)  # the health port is the kubelet's (a node's traffic is always let in)
    assert not allows(star, client, p["digits-grpc-client-1"], 50051)  # clients never reach each other
    assert not allows(star, server, client, 50051)

    metrics = kustomize(rendered["metrics"].out / "overlays" / "servicemonitor")
    server = pods_of(metrics)["digits-grpc-server"]
    scraper: Pod = ("monitoring", {"app.kubernetes.io/name": "prometheus", k8s.SCRAPER_LABEL: "true"})
    assert allows(metrics, scraper, server, 9100)
    assert not allows(metrics, ("monitoring", {"app.kubernetes.io/name": "prometheus"}), server, 9100)  # unlabelled
    assert not allows(metrics, pods_of(metrics)["digits-grpc-client-0"], server, 9100)
    assert allows(metrics, ("elsewhere", {}), server, 50051)  # --external-host: clients from outside

    hier = kustomize(rendered["hierarchical"].out / "base")
    p = pods_of(hier)
    leader0, member0, member1 = p["digits-hierarchical-site-0-leader"], p["digits-hierarchical-site-0-member-1"], \
        p["digits-hierarchical-site-1-member-1"]
    assert allows(hier, member0, leader0, 29500) and allows(hier, leader0, member0, 41234)  # gloo's own ports
    assert not allows(hier, member1, leader0, 29500)  # another site's pods
    assert allows(hier, leader0, p["digits-hierarchical-server"], 50051)
    assert not allows(hier, member0, p["digits-hierarchical-server"], 50051)  # members talk to their leader only

    dp = kustomize(rendered["data_parallel"].out / "base")
    (worker,) = pods_of(dp).values()
    assert allows(dp, worker, worker, 29500) and allows(dp, worker, worker, 37001)
    assert not allows(dp, ("default", {"app.kubernetes.io/name": "fedweave"}), worker, 29500)


def test_the_prometheus_port_is_served_scraped_and_monitored(rendered: dict[str, k8s.Rendered]) -> None:
    r = rendered["metrics"]
    objects = kustomize(r.out / "overlays" / "servicemonitor")
    server = by_kind(objects, "Job")[f"{r.name}-server"]["spec"]["template"]
    (c,) = server["spec"]["containers"]
    assert {"name": "metrics", "containerPort": 9100, "protocol": "TCP"} in c["ports"]
    assert server["metadata"]["annotations"] == {"prometheus.io/scrape": "true", "prometheus.io/port": "9100",
                                                 "prometheus.io/path": "/metrics"}
    service = by_kind(objects, "Service")[f"{r.name}-server"]
    assert {"name": "metrics", "port": 9100, "targetPort": "metrics", "protocol": "TCP"} in service["spec"]["ports"]
    (monitor,) = by_kind(objects, "ServiceMonitor").values()
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    assert "annotations" not in by_kind(kustomize(rendered["star"].out / "base"), "Job")["digits-grpc-server"]["spec"][
        "template"]["metadata"]


def test_clients_outside_the_cluster_reach_a_load_balancer_with_a_certificate_for_its_name(
    rendered: dict[str, k8s.Rendered], tmp_path: Path,
) -> None:
    r = rendered["metrics"]
    objects = kustomize(r.out / "base")
    external = by_kind(objects, "Service")[f"{r.name}-server-external"]
    assert external["spec"]["type"] == "LoadBalancer"
    assert external["spec"]["ports"] == [{"name": "grpc", "port": 50051, "targetPort": "grpc", "protocol": "TCP"}]
    pem = base64.b64decode(by_kind(objects, "Secret")[f"{r.name}-server"]["data"]["server.pem"])
    names = x509.load_pem_x509_certificate(pem).extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert "fl.example.org" in names.value.get_values_for_type(x509.DNSName)
    assert any("fl.example.org:50051" in note for note in r.notes)
    k8s.render(STAR, tmp_path)
    with pytest.raises(ConfigError, match="is not valid for fl.example.org; remove the folder"):
        k8s.render(STAR, tmp_path, k8s.Options(external_host="fl.example.org"))  # kept credentials lack the name


def test_resources_per_role_the_storage_class_and_what_the_render_states(
    rendered: dict[str, k8s.Rendered], tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "hier"
    assert cli.main(["deploy", "k8s", str(HIERARCHICAL), "--out", str(out), "--cpu", "2", "--cpu", "server=4",
                     "--memory", "site=8Gi", "--ephemeral-storage", "10Gi", "--tmp-size", "3Gi",
                     "--storage-class", "fast-ssd"]) == 0
    objects = kustomize(out / "base")
    for job in by_kind(objects, "Job").values():
        role = job["metadata"]["labels"]["app.kubernetes.io/component"]
        pod = job["spec"]["template"]["spec"]
        expected = {"cpu": "4" if role == "server" else "2", "memory": "8Gi" if role.startswith("site") else "2Gi",
                    "ephemeral-storage": "10Gi"}
        assert pod["containers"][0]["resources"]["limits"] == expected == pod["containers"][0]["resources"]["requests"]
        assert {"name": "tmp", "emptyDir": {"sizeLimit": "3Gi"}} in pod["volumes"]
    assert by_kind(objects, "PersistentVolumeClaim")["digits-hierarchical-run"]["spec"]["storageClassName"] == "fast-ssd"
    claim = by_kind(kustomize(rendered["data_parallel"].out / "base"), "PersistentVolumeClaim")
    assert next(iter(claim.values()))["spec"]["storageClassName"] == "nfs-client"
    claim_note, emulation = rendered["data_parallel"].notes  # the example emulates speeds 1:2:4
    assert "ReadWriteMany" in claim_note and "nfs-client" in claim_note
    assert emulation.startswith("warning: heterogeneity.speeds, heterogeneity.slowdown emulate")
    capsys.readouterr()
    assert cli.main(["deploy", "k8s", str(STAR), "--out", str(tmp_path / "slow"), "heterogeneity.speeds=[1,2,4]"]) == 0
    (warning,) = capsys.readouterr().err.splitlines()
    assert warning.startswith("fedweave deploy k8s: warning: heterogeneity.speeds emulate unlike machines")
    leader = by_kind(objects, "Job")["digits-hierarchical-site-0-leader"]["spec"]["template"]["spec"]["containers"][0]
    assert leader["livenessProbe"]["tcpSocket"] == {"port": "rendezvous"}


@pytest.mark.parametrize(
    "overrides, key",
    [
        (("grpc.health_listen=0.0.0.0:50051",), "grpc.health_listen"),
        (("observe.prometheus_port=8081",), "observe.prometheus_port"),
    ],
)
def test_a_port_shared_by_two_listeners_is_refused_at_render(tmp_path: Path, overrides: tuple[str, ...], key: str) -> None:
    with pytest.raises(ConfigError, match=f"^config key '{key}': port ") as err:
        k8s.render(STAR, tmp_path, k8s.Options(overrides=overrides))
    assert "\n" not in str(err.value) and not any(tmp_path.iterdir())
