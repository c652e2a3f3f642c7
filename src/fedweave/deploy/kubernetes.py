"""Kubernetes manifests for a config: ``fedweave deploy k8s CONFIG --out DIR``.

Writes a kustomize base and its overlays (``kubectl apply -k DIR/base`` or an overlay):

==============================  ==========================================================
``DIR/base/``                   ``kustomization.yaml``; ``config.yaml`` (the ConfigMap every pod
                                mounts); ``credentials/`` (``fedweave certs``' files, the source
                                of the Secrets: each pod mounts its own); the workloads
``DIR/overlays/gpu/``           the CUDA image (tag ``<tag>-cuda``), one GPU per training pod
``DIR/overlays/pytorchjob/``    (``mode: data_parallel``) a Kubeflow PyTorchJob with an
                                elasticPolicy in place of the Indexed Job
==============================  ==========================================================

The workloads follow the config: a federated star is the server (a Job restarted on failure,
which resumes from its run directory, a Service, the PersistentVolumeClaim of that run
directory, a NetworkPolicy) and one Job per client; a
hierarchical gRPC deployment has the same server and, per top-level site, a leader Job, a
headless Service for the site's torch.distributed rendezvous and one Job per member;
``mode: data_parallel`` is an Indexed Job of torchrun pods, the headless Service of its
rendezvous and the PersistentVolumeClaim (ReadWriteMany) of the run directory they share. Each client (and site leader) is a Job of its own rather than a pod of one
StatefulSet or Indexed Job, because pods of one template mount the same volumes: only a
pod of its own can hold a key that no other client can read.

The deployed config is the user's with the deployment's settings on top: the server's
Service name as ``grpc.address``, credentials at their mount path, mutual TLS and tokens on
(unless the command's own overrides say otherwise), clients that wait ten minutes for a
restarted server (unless the config sets ``grpc.connect_timeout``), and the plaintext health port
(``grpc.health_listen``) the kubelet's ``grpc`` probes ask, since they cannot present a
client certificate. Credentials already in ``DIR/base/credentials`` are kept, so rendering
again does not change any key.
"""

from __future__ import annotations

import argparse
import copy
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fedweave import __version__
from fedweave.transports.grpc import certs
from fedweave import config as config_mod
from fedweave.config import Config
from fedweave.errors import ConfigError
from fedweave.files import atomic_write_text

KUBERNETES_VERSION = "1.33.0"
"""The Kubernetes version the rendered manifests are validated against (tests/deploy)."""

IMAGE = f"fedweave:{__version__}"
UID = 10001  # the image's non-root user (Dockerfile)
CONFIG_DIR = "/etc/fedweave/config"
CONFIG_FILE = "config.yaml"
CONFIG_PATH = f"{CONFIG_DIR}/{CONFIG_FILE}"
CREDENTIALS_DIR = "/etc/fedweave/credentials"
SCRATCH = "/tmp"
"""The container's only writable folder (an emptyDir; the root filesystem is read-only): HOME and
matplotlib's cache live there."""
DATA_DIR = "/var/lib/fedweave"
RUN_DIR = f"{DATA_DIR}/run"
HEALTH_PORT = 8081
CLIENT_PATIENCE = 600
"""Seconds a deployed client keeps retrying an unreachable server (``grpc.connect_timeout``, unless the
config sets it): a restarted server pod may take minutes (the kubelet's back-off, a reschedule)."""
RENDEZVOUS_PORT = 29500
TRAINERS = ("client", "site-member", "worker")  # the pods that train: a GPU each in the gpu overlay
PYTORCHJOB_API = "kubeflow.org/v1"


@dataclass(frozen=True)
class Options:
    """What the command line adds to the config."""

    image: str = IMAGE
    namespace: str = "default"
    cpu: str = "1"
    memory: str = "2Gi"
    storage: str = "1Gi"
    overrides: Sequence[str] = ()


@dataclass
class Rendered:
    out: Path
    name: str
    kustomizations: list[Path] = field(default_factory=list)  # base first, then the overlays


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``fedweave deploy k8s``."""
    parser.add_argument("config", help="YAML config file of the run to deploy")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rounds=50 grpc.tls=tls")
    parser.add_argument("--out", required=True, metavar="DIR", help="folder to write base/ and overlays/ into")
    parser.add_argument("--image", default=IMAGE, metavar="IMG", help=f"container image (default {IMAGE})")
    parser.add_argument("--namespace", default="default", metavar="NS", help="namespace (default: default)")
    parser.add_argument("--cpu", default="1", help="CPU request and limit of each pod (default 1)")
    parser.add_argument("--memory", default="2Gi", help="memory request and limit of each pod (default 2Gi)")
    parser.add_argument("--storage", default="1Gi", help="size of the server's run-directory volume (default 1Gi)")


def render_args(args: argparse.Namespace) -> Rendered:
    """``fedweave deploy k8s`` with parsed ``args``."""
    options = Options(args.image, args.namespace, args.cpu, args.memory, args.storage, tuple(args.overrides))
    return render(args.config, args.out, options)


def k8s_name(text: str) -> str:
    """``text`` as a DNS-1123 label short enough to take suffixes such as ``-site-12-member-3``."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:36].strip("-")
    return name or "fedweave"


def _port(address: str) -> int:
    return int(address.rpartition(":")[2])


def deployed_config(path: str | Path, options: Options) -> tuple[dict[str, Any], Config, str]:
    """The config the pods read (the user's keys, the deployment's on top), its validated form and
    the deployment's name."""
    data = config_mod.read_yaml(path)
    # The user's config, for its name, mode, topology and ports: with credentials at their mount path
    # (a TLS choice of the command's needs them) and torch.distributed inside sites (as deployed).
    first = ["topology.inner=torchdist", *options.overrides, f"grpc.credentials={CREDENTIALS_DIR}"]
    user = config_mod.from_dict(config_mod.apply_overrides(copy.deepcopy(data), first))
    name = k8s_name(user.name)
    if user.mode == "data_parallel":
        data = config_mod.apply_overrides(data, list(options.overrides))
        return data, config_mod.from_dict(copy.deepcopy(data)), name
    defaults = ["transport=grpc", "grpc.tls=mtls", "grpc.tokens=true"]
    if "connect_timeout" not in (data.get("grpc") or {}):  # clients outwait a server pod's restart
        defaults.append(f"grpc.connect_timeout={CLIENT_PATIENCE}")
    if user.topology.kind == "hierarchical":
        defaults.append("topology.inner=torchdist")  # a site's pods reach each other over torch.distributed
    port = _port(user.grpc.address)
    health = _port(user.grpc.health_listen) if user.grpc.health_listen else HEALTH_PORT
    forced = [
        f"grpc.address={name}-server:{port}",
        f"grpc.listen=0.0.0.0:{port}",
        f"grpc.health_listen=0.0.0.0:{health}",
        f"grpc.credentials={CREDENTIALS_DIR}",
        "launcher=local",  # each pod runs one node
    ]
    data = config_mod.apply_overrides(data, [*defaults, *options.overrides, *forced])
    config = config_mod.from_dict(copy.deepcopy(data))
    if config.transport.kind != "grpc":
        raise ConfigError("config key 'transport': a Kubernetes deployment runs its nodes over grpc")
    return data, config, name


QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|Ki|Mi|Gi|Ti)?$")
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def _check(options: Options) -> None:
    for flag, value in (("--cpu", options.cpu), ("--memory", options.memory), ("--storage", options.storage)):
        if not QUANTITY.match(value):
            raise ConfigError(f"fedweave deploy k8s: {flag} {value!r} is not a Kubernetes quantity (e.g. 500m, 2, 4Gi)")
    if not DNS_LABEL.match(options.namespace):
        raise ConfigError(
            f"fedweave deploy k8s: --namespace {options.namespace!r} is not a DNS label (lower case letters, digits, '-')"
        )
    if not options.image or any(ch.isspace() for ch in options.image):
        raise ConfigError(f"fedweave deploy k8s: --image {options.image!r} is not an image reference")


def render(path: str | Path, out: str | Path, options: Options = Options()) -> Rendered:
    """Write the kustomize base and overlays for the config at ``path`` into ``out``."""
    if not Path(path).is_file():
        raise ConfigError(f"fedweave deploy k8s: no config file {str(path)!r}")
    _check(options)
    data, config, name = deployed_config(path, options)
    k = _Manifests(config, name, options)
    out = Path(out)
    base = out / "base"
    result = Rendered(out, name)
    files: dict[str, list[dict[str, Any]]] = {}
    if options.namespace != "default":
        files["namespace.yaml"] = [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": options.namespace}}]
    secrets: dict[str, list[str]] = {}
    if config.mode == "data_parallel":
        files["workers.yaml"] = k.workers()
    else:
        files["server.yaml"] = k.server()
        secrets[f"{name}-server"] = [certs.CA_CERT, certs.SERVER_CERT, certs.SERVER_KEY, certs.TOKENS]
        sites = k.num_sites if config.topology.kind == "hierarchical" else 0
        if sites:
            files["sites.yaml"] = k.sites()
            nodes = [certs.site_name(s) for s in range(sites)]
        else:
            files["clients.yaml"] = k.clients()
            nodes = [certs.client_name(c) for c in range(config.clients)]
        for node in nodes:
            secrets[f"{name}-{node}"] = [certs.CA_CERT, certs.cert_file(node), certs.key_file(node), certs.token_file(node)]
        _credentials(base / "credentials", config.clients, sites, _server_hosts(name, options.namespace), secrets)
    _write(yaml.safe_dump(data, sort_keys=False), base / CONFIG_FILE)
    for file, objects in files.items():
        _write(yaml.safe_dump_all(objects, sort_keys=False), base / file)
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": options.namespace,
        "resources": list(files),
        "configMapGenerator": [{"name": f"{name}-config", "files": [CONFIG_FILE]}],
        "secretGenerator": [
            {"name": secret, "type": "Opaque", "files": [f"credentials/{f}" for f in names]}
            for secret, names in secrets.items()
        ],
        "generatorOptions": {"disableNameSuffixHash": True, "labels": k.labels()},
    }
    if not secrets:
        del kustomization["secretGenerator"]
    result.kustomizations.append(_write_kustomization(base, kustomization))
    result.kustomizations.append(_write_kustomization(out / "overlays" / "gpu", k.gpu_overlay()))
    if config.mode == "data_parallel":
        pytorchjob = out / "overlays" / "pytorchjob"
        _write(yaml.safe_dump(k.pytorchjob(), sort_keys=False), pytorchjob / "pytorchjob.yaml")
        result.kustomizations.append(_write_kustomization(pytorchjob, k.pytorchjob_overlay()))
    return result


def _write(text: str, path: Path) -> None:
    """Write ``path`` (and its folders) through a temporary file and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(text, path)


def _write_kustomization(folder: Path, body: dict[str, Any]) -> Path:
    path = folder / "kustomization.yaml"
    _write(yaml.safe_dump(body, sort_keys=False), path)
    return path


def _server_hosts(name: str, namespace: str) -> list[str]:
    """The names the server's certificate is valid for: its Service's, and localhost for ``kubectl port-forward``."""
    service = f"{name}-server"
    return [
        service, f"{service}.{namespace}", f"{service}.{namespace}.svc", f"{service}.{namespace}.svc.cluster.local",
        *certs.DEFAULT_HOSTS,
    ]


def _credentials(folder: Path, clients: int, sites: int, hosts: list[str], secrets: dict[str, list[str]]) -> None:
    """``fedweave certs`` into ``folder`` (kept when there already); every file a Secret names must be there."""
    if not (folder / certs.CA_CERT).exists():
        certs.make_credentials(folder, clients, hosts, sites=sites)
        _write("# private keys and tokens: never commit them\n*\n", folder / ".gitignore")
    missing = sorted({f for names in secrets.values() for f in names if not (folder / f).is_file()})
    if missing:
        raise ConfigError(
            f"fedweave deploy k8s: {folder} lacks {', '.join(missing)}; remove the folder to create new "
            "credentials, or fill it with `fedweave certs`"
        )


class _Manifests:
    """The objects of one deployment (dicts, as ``kubectl`` reads them)."""

    def __init__(self, config: Config, name: str, options: Options):
        self.config = config
        self.name = name
        self.options = options
        if config.mode == "federated":
            self.port = _port(config.grpc.address)
            self.health_port = _port(config.grpc.health_listen or f":{HEALTH_PORT}")
        if config.topology.kind == "hierarchical":
            from fedweave.topologies.deploy import site_members, site_port
            from fedweave.topologies.hierarchical import site_tree

            self.num_sites = len(site_tree(config.topology.sites, config.clients))  # type: ignore[arg-type]
            self.site_members = [len(site_members(config, s)) for s in range(self.num_sites)]
            self.site_ports = [site_port(config, s) for s in range(self.num_sites)]

    # ------------------------------------------------------------------ shared parts

    def labels(self, component: str | None = None) -> dict[str, str]:
        labels = {"app.kubernetes.io/name": "fedweave", "app.kubernetes.io/instance": self.name}
        if component is not None:
            labels["app.kubernetes.io/component"] = component
        return labels

    def meta(self, name: str, component: str, extra: dict[str, str] | None = None) -> dict[str, Any]:
        return {"name": name, "namespace": self.options.namespace, "labels": {**self.labels(component), **(extra or {})}}

    def container(
        self,
        name: str,
        args: list[str],
        mounts: list[dict[str, Any]],
        *,
        command: list[str] | None = None,
        ports: list[dict[str, Any]] | None = None,
        env: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        o = self.options
        body: dict[str, Any] = {"name": name, "image": o.image, "imagePullPolicy": "IfNotPresent"}
        if command is not None:
            body["command"] = command
        body["args"] = args
        if ports:
            body["ports"] = ports
        body["env"] = [
            {"name": "HOME", "value": SCRATCH},
            {"name": "MPLCONFIGDIR", "value": f"{SCRATCH}/matplotlib"},
            *(env or []),
        ]
        body["resources"] = {
            "requests": {"cpu": o.cpu, "memory": o.memory},
            "limits": {"cpu": o.cpu, "memory": o.memory},
        }
        body["volumeMounts"] = [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "tmp", "mountPath": SCRATCH},
            *mounts,
        ]
        body["securityContext"] = {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        }
        return body

    def pod_spec(self, container: dict[str, Any], volumes: list[dict[str, Any]], restart: str) -> dict[str, Any]:
        return {
            "restartPolicy": restart,
            "automountServiceAccountToken": False,
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": UID,
                "runAsGroup": UID,
                "fsGroup": UID,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [container],
            "volumes": [
                {"name": "config", "configMap": {"name": f"{self.name}-config"}},
                {"name": "tmp", "emptyDir": {}},
                *volumes,
            ],
        }

    def secret_volume(self, node: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """The volume of ``node``'s Secret and its mount at the credentials path (readable by the pod's group)."""
        volume = {"name": "credentials", "secret": {"secretName": f"{self.name}-{node}", "defaultMode": 0o440}}
        return volume, {"name": "credentials", "mountPath": CREDENTIALS_DIR, "readOnly": True}

    def job(
        self, name: str, component: str, container: dict[str, Any], volumes: list[dict[str, Any]],
        extra: dict[str, str] | None = None, **spec: Any,
    ) -> dict[str, Any]:
        meta = self.meta(name, component, extra)
        return {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": meta,
            "spec": {
                **spec,
                "backoffLimit": spec.get("backoffLimit", 6),
                "template": {
                    "metadata": {"labels": meta["labels"]},
                    "spec": self.pod_spec(container, volumes, "OnFailure"),
                },
            },
        }

    # ------------------------------------------------------------------ federated

    def server(self) -> list[dict[str, Any]]:
        n, port, health = self.name, self.port, self.health_port
        volume, mount = self.secret_volume("server")
        probe = {"grpc": {"port": health}, "periodSeconds": 10, "timeoutSeconds": 2}
        container = self.container(
            "server",
            ["server", CONFIG_PATH, "--run-dir", RUN_DIR],
            [mount, {"name": "run", "mountPath": DATA_DIR}],
            ports=[
                {"name": "grpc", "containerPort": port, "protocol": "TCP"},
                {"name": "health", "containerPort": health, "protocol": "TCP"},
            ],
        )
        container["readinessProbe"] = {**probe, "failureThreshold": 3}
        container["livenessProbe"] = {**probe, "initialDelaySeconds": 30, "failureThreshold": 6}
        pvc = {"name": "run", "persistentVolumeClaim": {"claimName": f"{n}-run"}}
        selector = self.labels("server")
        return [
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": self.meta(f"{n}-run", "server"),
                "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": self.options.storage}}},
            },
            # A Job, not a Deployment: a crashed server is restarted with the same arguments and resumes
            # from its run directory's checkpoint, and a finished one completes instead of being restarted
            # forever. A replacement pod starts only once the previous one has ended: one writer at a time.
            self.job(f"{n}-server", "server", container, [volume, pvc], podReplacementPolicy="Failed"),
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": self.meta(f"{n}-server", "server"),
                "spec": {
                    "selector": selector,
                    "ports": [{"name": "grpc", "port": port, "targetPort": "grpc", "protocol": "TCP"}],
                },
            },
            {
                "apiVersion": "networking.k8s.io/v1",
                "kind": "NetworkPolicy",
                "metadata": self.meta(f"{n}-server", "server"),
                "spec": {
                    "podSelector": {"matchLabels": selector},
                    "policyTypes": ["Ingress"],
                    "ingress": [
                        {
                            "from": [
                                {
                                    "podSelector": {
                                        "matchLabels": self.labels(),
                                        "matchExpressions": [
                                            {
                                                "key": "app.kubernetes.io/component",
                                                "operator": "In",
                                                "values": ["client", "site-leader"],
                                            }
                                        ],
                                    }
                                }
                            ],
                            "ports": [{"port": port, "protocol": "TCP"}],
                        }
                    ],
                },
            },
        ]

    def clients(self) -> list[dict[str, Any]]:
        jobs = []
        for cid in range(self.config.clients):
            node = certs.client_name(cid)
            volume, mount = self.secret_volume(node)
            container = self.container("client", ["client", CONFIG_PATH, "--id", str(cid)], [mount])
            jobs.append(self.job(f"{self.name}-{node}", "client", container, [volume], {"fedweave.io/client": str(cid)}))
        return jobs

    def sites(self) -> list[dict[str, Any]]:
        """Per top-level site: the leader's Job and rendezvous Service, a Job per member."""
        objects = []
        for s in range(self.num_sites):
            node = certs.site_name(s)
            service = f"{self.name}-{node}"
            port = self.site_ports[s]
            common = [CONFIG_PATH, "--site", str(s)]
            site_args = ["--port", str(port), f"torchdist.address={service}"]
            leader_labels = {"fedweave.io/site": str(s)}
            volume, mount = self.secret_volume(node)
            leader = self.container(
                "site-leader",
                ["site", *common, "--rank", "0", *site_args],
                [mount],
                ports=[{"name": "rendezvous", "containerPort": port, "protocol": "TCP"}],
            )
            objects.append(self.job(f"{service}-leader", "site-leader", leader, [volume], leader_labels))
            objects.append(
                {
                    "apiVersion": "v1",
                    "kind": "Service",
                    "metadata": self.meta(service, "site-leader", leader_labels),
                    "spec": {
                        "clusterIP": "None",
                        "publishNotReadyAddresses": True,  # members find the leader before it is ready
                        "selector": self.labels("site-leader") | leader_labels,
                        "ports": [{"name": "rendezvous", "port": port, "targetPort": port, "protocol": "TCP"}],
                    },
                }
            )
            for rank in range(1, self.site_members[s] + 1):
                member = self.container("site-member", ["site", *common, "--rank", str(rank), *site_args], [])
                labels = {"fedweave.io/site": str(s), "fedweave.io/rank": str(rank)}
                objects.append(self.job(f"{service}-member-{rank}", "site-member", member, [], labels))
        return objects

    # ------------------------------------------------------------------ data-parallel

    def torchrun_args(self) -> list[str]:
        return ["-m", "fedweave.data_parallel", CONFIG_PATH, "--run-dir", RUN_DIR]

    def torchrun_container(self, name: str, args: list[str], **extra: Any) -> dict[str, Any]:
        """A torchrun container: the job's run directory on the shared claim, and the environment an
        elastic join needs (torch 2.13's agents otherwise share a rendezvous store a joining host never reaches)."""
        env = [{"name": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "value": "1"}]
        mount = {"name": "run", "mountPath": DATA_DIR}
        return self.container(name, [*args, *self.torchrun_args()], [mount], command=["torchrun"], env=env, **extra)

    def run_volume(self) -> dict[str, Any]:
        return {"name": "run", "persistentVolumeClaim": {"claimName": f"{self.name}-run"}}

    def run_claim(self) -> dict[str, Any]:
        """The run directory every worker pod sees (ReadWriteMany: pods on many nodes): the model, the metrics,
        and the checkpoint restarted workers resume from."""
        return {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": self.meta(f"{self.name}-run", "worker"),
            "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": self.options.storage}}},
        }

    def workers(self) -> list[dict[str, Any]]:
        """An Indexed Job of torchrun pods (node rank = completion index), its headless Service and the claim
        of its run directory."""
        n, workers = f"{self.name}-workers", self.config.data_parallel.workers
        rendezvous = f"{n}-0.{n}"  # pod 0's name under the headless Service
        container = self.torchrun_container(
            "worker",
            [
                f"--nnodes={workers}",
                "--nproc-per-node=1",
                "--node-rank=$(JOB_COMPLETION_INDEX)",
                f"--master-addr={rendezvous}",
                f"--master-port={RENDEZVOUS_PORT}",
            ],
            ports=[{"name": "rendezvous", "containerPort": RENDEZVOUS_PORT, "protocol": "TCP"}],
        )
        job = self.job(
            n, "worker", container, [self.run_volume()],
            completions=workers, parallelism=workers, completionMode="Indexed", backoffLimit=0,
        )
        job["spec"]["template"]["spec"]["subdomain"] = n
        service = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": self.meta(n, "worker"),
            "spec": {
                "clusterIP": "None",
                "publishNotReadyAddresses": True,
                "selector": self.labels("worker"),
                "ports": [{"name": "rendezvous", "port": RENDEZVOUS_PORT, "targetPort": RENDEZVOUS_PORT}],
            },
        }
        return [self.run_claim(), job, service]

    def pytorchjob(self) -> dict[str, Any]:
        """The Kubeflow training operator's PyTorchJob: elastic torchrun workers (the operator sets PET_* for torchrun)."""
        dp = self.config.data_parallel
        container = self.torchrun_container("pytorch", [])
        meta = self.meta(f"{self.name}-workers", "worker")
        return {
            "apiVersion": PYTORCHJOB_API,
            "kind": "PyTorchJob",
            "metadata": meta,
            "spec": {
                "elasticPolicy": {
                    "rdzvBackend": "c10d",
                    "minReplicas": min(dp.min_workers, dp.workers),
                    "maxReplicas": dp.workers,
                    "maxRestarts": 3,
                },
                "nprocPerNode": "1",
                "runPolicy": {"cleanPodPolicy": "None", "backoffLimit": 3},
                "pytorchReplicaSpecs": {
                    "Worker": {
                        "replicas": dp.workers,
                        "restartPolicy": "OnFailure",
                        "template": {
                            "metadata": {"labels": meta["labels"]},
                            "spec": self.pod_spec(container, [self.run_volume()], "OnFailure"),
                        },
                    }
                },
            },
        }

    def pytorchjob_overlay(self) -> dict[str, Any]:
        n = f"{self.name}-workers"
        delete = [
            {"apiVersion": "batch/v1", "kind": "Job"},
            {"apiVersion": "v1", "kind": "Service"},
        ]
        return {
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            "resources": ["../../base", "pytorchjob.yaml"],
            "patches": [
                {"patch": yaml.safe_dump({"$patch": "delete", **d, "metadata": {"name": n}}, sort_keys=False)}
                for d in delete
            ],
        }

    # ------------------------------------------------------------------ overlays

    def gpu_overlay(self) -> dict[str, Any]:
        """The CUDA image (``<tag>-cuda``, see the Dockerfile) and one GPU per training pod."""
        image, _, tag = self.options.image.rpartition(":")
        if not image or "/" in tag:
            image, tag = self.options.image, "latest"
        add_gpu = yaml.safe_dump(
            [{"op": "add", "path": "/spec/template/spec/containers/0/resources/limits/nvidia.com~1gpu", "value": 1}],
            sort_keys=False,
        )
        return {
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            "resources": ["../../base"],
            "images": [{"name": image, "newTag": f"{tag}-cuda"}],
            "patches": [
                {
                    "target": {"kind": "Job", "labelSelector": f"app.kubernetes.io/component in ({','.join(TRAINERS)})"},
                    "patch": add_gpu,
                }
            ],
        }
