"""The objects of one deployment, as dicts ``kubectl`` reads: pods, Jobs, Services, claims,
the NetworkPolicy, the PyTorchJob and the overlays."""

from __future__ import annotations

from typing import Any

import yaml

from fedweave.config import Config
from fedweave.deploy.kubernetes.layout import (
    CONFIG_DIR,
    CONFIG_PATH,
    CREDENTIALS_DIR,
    DATA_DIR,
    HEALTH_PORT,
    PYTORCHJOB_API,
    RENDEZVOUS_PORT,
    RUN_DIR,
    SCRATCH,
    TRAINERS,
    UID,
    Options,
    port_of,
)
from fedweave.transports.grpc import certs


class Manifests:
    """The objects of one deployment (dicts, as ``kubectl`` reads them)."""

    def __init__(self, config: Config, name: str, options: Options):
        self.config = config
        self.name = name
        self.options = options
        if config.mode == "federated":
            self.port = port_of(config.grpc.address)
            self.health_port = port_of(config.grpc.health_listen or f":{HEALTH_PORT}")
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
