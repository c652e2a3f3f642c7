"""The objects of one deployment, as dicts ``kubectl`` reads: pods, Jobs, Services, claims,
the NetworkPolicies, the PyTorchJob and the overlays."""

from __future__ import annotations

from typing import Any

import yaml

from fedweave.config import Config
from fedweave.deploy.kubernetes.layout import (
    CONFIG_DIR,
    CONFIG_PATH,
    CREDENTIALS_DIR,
    DATA_DIR,
    GPU_RESOURCE,
    HEALTH_PORT,
    HEARTBEAT_FILE,
    PROBE_PERIOD,
    PYTORCHJOB_API,
    RENDEZVOUS_PORT,
    ROLE_OF,
    RUN_DIR,
    SCRATCH,
    SCRAPER_LABEL,
    SERVICEMONITOR_API,
    STARTUP_SECONDS,
    UID,
    ImageRef,
    Options,
    port_of,
)
from fedweave.liveness import HEARTBEAT_ENV
from fedweave.transports.grpc import certs

DNS = {
    "to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
            "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}],
    "ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}],
}
"""Egress to the cluster's DNS (CoreDNS and kube-dns both carry ``k8s-app: kube-dns``)."""


class Manifests:
    """The objects of one deployment (dicts, as ``kubectl`` reads them)."""

    def __init__(self, config: Config, name: str, options: Options):
        self.config = config
        self.name = name
        self.options = options
        self.metrics_port: int | None = None
        if config.mode == "federated":
            self.port = port_of(config.grpc.address)
            self.health_port = port_of(config.grpc.health_listen or f":{HEALTH_PORT}")
            self.metrics_port = config.observe.prometheus_port
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

    def device(self, component: str) -> str:
        """``cuda`` or ``cpu``: where the pods of ``component`` train (``local.device``; a worker also
        with ``data_parallel.backend: nccl``); the server aggregates on the CPU."""
        if component == "server":
            return "cpu"
        if component == "worker" and self.config.data_parallel.backend == "nccl":
            return "cuda"
        return "cuda" if str(getattr(self.config.local, "device", "cpu")).startswith("cuda") else "cpu"

    def cuda_image(self) -> str | None:
        """The image of the cuda pods: ``--gpu-image``, else the CUDA build of ``--image``'s tag."""
        return self.options.gpu_image or ImageRef.parse(self.options.image).cuda()

    def container(
        self,
        name: str,
        component: str,
        args: list[str],
        mounts: list[dict[str, Any]],
        *,
        command: list[str] | None = None,
        ports: list[dict[str, Any]] | None = None,
        env: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        o = self.options
        cuda = self.device(component) == "cuda"
        body: dict[str, Any] = {"name": name, "image": self.cuda_image() if cuda else o.image,
                                "imagePullPolicy": "IfNotPresent"}
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
        role = ROLE_OF[component]
        amounts = {"cpu": o.resource(role, "cpu"), "memory": o.resource(role, "memory"),
                   "ephemeral-storage": o.ephemeral_storage}
        body["resources"] = {"requests": amounts, "limits": {**amounts, **({GPU_RESOURCE: 1} if cuda else {})}}
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

    def watched(self, container: dict[str, Any]) -> dict[str, Any]:
        """``container`` with its liveness file (a node that listens on no port touches it while its loop
        runs) and the exec probes that read it with ``fedweave probe``: the startup probe waits up to
        :data:`STARTUP_SECONDS` for the first touch, then the liveness probe fails the pod once the file is
        older than ``grpc.heartbeat_timeout`` (the server's own bound on a silent client)."""
        max_age = f"{self.config.grpc.heartbeat_timeout:g}"

        def probe(failures: int) -> dict[str, Any]:
            check = ["fedweave", "probe", "--heartbeat", HEARTBEAT_FILE, "--max-age", max_age]
            return {"exec": {"command": check}, "periodSeconds": PROBE_PERIOD, "timeoutSeconds": 5,
                    "failureThreshold": failures}

        container["env"].append({"name": HEARTBEAT_ENV, "value": HEARTBEAT_FILE})
        container["startupProbe"] = probe(STARTUP_SECONDS // PROBE_PERIOD)
        container["livenessProbe"] = probe(3)
        return container

    def pod_spec(self, component: str, container: dict[str, Any], volumes: list[dict[str, Any]],
                 restart: str) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "restartPolicy": restart,
            "automountServiceAccountToken": False,
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": UID,
                "runAsGroup": UID,
                "fsGroup": UID,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
        }
        if self.device(component) == "cuda":
            spec["nodeSelector"] = dict(self.options.gpu_node_selector)
            spec["tolerations"] = [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
        spec["containers"] = [container]
        spec["volumes"] = [
            {"name": "config", "configMap": {"name": f"{self.name}-config"}},
            {"name": "tmp", "emptyDir": {"sizeLimit": self.options.tmp_size}},
            *volumes,
        ]
        return spec

    def secret_volume(self, node: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """The volume of ``node``'s Secret and its mount at the credentials path (readable by the pod's group)."""
        volume = {"name": "credentials", "secret": {"secretName": f"{self.name}-{node}", "defaultMode": 0o440}}
        return volume, {"name": "credentials", "mountPath": CREDENTIALS_DIR, "readOnly": True}

    def job(
        self, name: str, component: str, container: dict[str, Any], volumes: list[dict[str, Any]],
        extra: dict[str, str] | None = None, annotations: dict[str, str] | None = None, **spec: Any,
    ) -> dict[str, Any]:
        meta = self.meta(name, component, extra)
        template: dict[str, Any] = {"labels": meta["labels"]}
        if annotations:
            template["annotations"] = annotations
        return {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": meta,
            "spec": {
                **spec,
                "backoffLimit": spec.get("backoffLimit", 6),
                "template": {"metadata": template, "spec": self.pod_spec(component, container, volumes, "OnFailure")},
            },
        }

    def claim(self, component: str, access: str) -> dict[str, Any]:
        """The PersistentVolumeClaim of the run directory (``--storage``, ``--storage-class``)."""
        spec: dict[str, Any] = {"accessModes": [access], "resources": {"requests": {"storage": self.options.storage}}}
        if self.options.storage_class is not None:
            spec["storageClassName"] = self.options.storage_class
        return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": self.meta(f"{self.name}-run", component),
                "spec": spec}

    def pods(self, *components: str, **labels: str) -> dict[str, Any]:
        """The selector of this deployment's pods of ``components`` (and ``labels``)."""
        selector: dict[str, Any] = {"matchLabels": {**self.labels(), **labels}}
        if components:
            selector["matchExpressions"] = [
                {"key": "app.kubernetes.io/component", "operator": "In", "values": list(components)}
            ]
        return selector

    def policy(self, name: str, component: str, selector: dict[str, Any], ingress: list[dict[str, Any]],
               egress: list[dict[str, Any]]) -> dict[str, Any]:
        """A NetworkPolicy: the pods ``selector`` picks take only ``ingress`` and reach only the DNS and ``egress``."""
        return {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": self.meta(name, component),
            "spec": {"podSelector": selector, "policyTypes": ["Ingress", "Egress"], "ingress": ingress,
                     "egress": [DNS, *egress]},
        }

    # ------------------------------------------------------------------ federated

    def server(self) -> list[dict[str, Any]]:
        n, port, health, metrics = self.name, self.port, self.health_port, self.metrics_port
        volume, mount = self.secret_volume("server")
        probe = {"grpc": {"port": health}, "periodSeconds": 10, "timeoutSeconds": 2}
        ports = [
            {"name": "grpc", "containerPort": port, "protocol": "TCP"},
            {"name": "health", "containerPort": health, "protocol": "TCP"},
        ]
        service_ports = [{"name": "grpc", "port": port, "targetPort": "grpc", "protocol": "TCP"}]
        annotations = None
        if metrics is not None:
            ports.append({"name": "metrics", "containerPort": metrics, "protocol": "TCP"})
            service_ports.append({"name": "metrics", "port": metrics, "targetPort": "metrics", "protocol": "TCP"})
            annotations = {"prometheus.io/scrape": "true", "prometheus.io/port": str(metrics),
                           "prometheus.io/path": "/metrics"}
        container = self.container(
            "server", "server", ["server", CONFIG_PATH, "--run-dir", RUN_DIR],
            [mount, {"name": "run", "mountPath": DATA_DIR}], ports=ports,
        )
        container["readinessProbe"] = {**probe, "failureThreshold": 3}
        container["livenessProbe"] = {**probe, "initialDelaySeconds": 30, "failureThreshold": 6}
        pvc = {"name": "run", "persistentVolumeClaim": {"claimName": f"{n}-run"}}
        selector = self.labels("server")
        # the federation port: the job's clients and site leaders, or anyone where clients come from outside
        federation: dict[str, Any] = {"ports": [{"port": port, "protocol": "TCP"}]}
        if self.options.external_host is None:
            federation["from"] = [{"podSelector": self.pods("client", "site-leader")}]
        ingress = [federation]
        if metrics is not None:
            scrapers = {"namespaceSelector": {}, "podSelector": {"matchLabels": {SCRAPER_LABEL: "true"}}}
            ingress.append({"from": [scrapers], "ports": [{"port": metrics, "protocol": "TCP"}]})
        objects = [
            self.claim("server", "ReadWriteOnce"),
            # A Job, not a Deployment: a crashed server is restarted with the same arguments and resumes
            # from its run directory's checkpoint, and a finished one completes instead of being restarted
            # forever. A replacement pod starts only once the previous one has ended: one writer at a time.
            self.job(f"{n}-server", "server", container, [volume, pvc], annotations=annotations,
                     podReplacementPolicy="Failed"),
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": self.meta(f"{n}-server", "server"),
                "spec": {"selector": selector, "ports": service_ports},
            },
            self.policy(f"{n}-server", "server", {"matchLabels": selector}, ingress, []),
            # clients and site leaders listen on nothing and reach the server alone
            self.policy(f"{n}-clients", "client", self.pods("client", "site-leader"), [],
                        [{"to": [{"podSelector": {"matchLabels": selector}}],
                          "ports": [{"port": port, "protocol": "TCP"}]}]),
        ]
        if self.options.external_host is not None:
            objects.append({
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": self.meta(f"{n}-server-external", "server"),
                "spec": {"type": "LoadBalancer", "selector": selector, "ports": service_ports[:1]},
            })
        return objects

    def clients(self) -> list[dict[str, Any]]:
        jobs = []
        for cid in range(self.config.clients):
            node = certs.client_name(cid)
            volume, mount = self.secret_volume(node)
            container = self.watched(
                self.container("client", "client", ["client", CONFIG_PATH, "--id", str(cid)], [mount]))
            jobs.append(self.job(f"{self.name}-{node}", "client", container, [volume], {"fedweave.io/client": str(cid)}))
        return jobs

    def sites(self) -> list[dict[str, Any]]:
        """Per top-level site: the leader's Job and rendezvous Service, a Job per member, and the NetworkPolicy
        that lets the site's pods (and no others) reach each other: their torch.distributed ports are
        unauthenticated."""
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
                "site-leader", "site-leader",
                ["site", *common, "--rank", "0", *site_args],
                [mount],
                ports=[{"name": "rendezvous", "containerPort": port, "protocol": "TCP"}],
            )
            probe = {"tcpSocket": {"port": "rendezvous"}, "periodSeconds": PROBE_PERIOD, "timeoutSeconds": 2}
            leader["startupProbe"] = {**probe, "failureThreshold": STARTUP_SECONDS // PROBE_PERIOD}
            leader["livenessProbe"] = {**probe, "failureThreshold": 6}
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
                member = self.watched(self.container("site-member", "site-member",
                                                     ["site", *common, "--rank", str(rank), *site_args], []))
                labels = {"fedweave.io/site": str(s), "fedweave.io/rank": str(rank)}
                objects.append(self.job(f"{service}-member-{rank}", "site-member", member, [], labels))
            site = self.pods("site-leader", "site-member", **leader_labels)
            objects.append(self.policy(service, "site-leader", site, [{"from": [{"podSelector": site}]}],
                                       [{"to": [{"podSelector": site}]}]))
        return objects

    # ------------------------------------------------------------------ data-parallel

    def torchrun_args(self) -> list[str]:
        return ["-m", "fedweave.data_parallel", CONFIG_PATH, "--run-dir", RUN_DIR]

    def torchrun_container(self, name: str, args: list[str], **extra: Any) -> dict[str, Any]:
        """A torchrun container: the job's run directory on the shared claim, and the environment an
        elastic join needs (torch 2.13's agents otherwise share a rendezvous store a joining host never reaches)."""
        env = [{"name": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "value": "1"}]
        mount = {"name": "run", "mountPath": DATA_DIR}
        return self.watched(self.container(name, "worker", [*args, *self.torchrun_args()], [mount],
                                           command=["torchrun"], env=env, **extra))

    def run_volume(self) -> dict[str, Any]:
        return {"name": "run", "persistentVolumeClaim": {"claimName": f"{self.name}-run"}}

    def workers(self) -> list[dict[str, Any]]:
        """An Indexed Job of torchrun pods (node rank = completion index), its headless Service, the claim
        of its run directory (ReadWriteMany: pods on many nodes; the model, the metrics, and the checkpoint
        restarted workers resume from) and the NetworkPolicy of the workers' unauthenticated gloo ports."""
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
        peers = self.pods("worker")
        policy = self.policy(n, "worker", peers, [{"from": [{"podSelector": peers}]}], [{"to": [{"podSelector": peers}]}])
        return [self.claim("worker", "ReadWriteMany"), job, service, policy]

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
                            "spec": self.pod_spec("worker", container, [self.run_volume()], "OnFailure"),
                        },
                    }
                },
            },
        }

    # ------------------------------------------------------------------ overlays

    def pytorchjob_overlay(self) -> dict[str, Any]:
        n = f"{self.name}-workers"
        delete = [
            {"apiVersion": "batch/v1", "kind": "Job"},
            {"apiVersion": "v1", "kind": "Service"},
        ]
        return overlay(
            ["../../base", "pytorchjob.yaml"],
            patches=[
                {"patch": yaml.safe_dump({"$patch": "delete", **d, "metadata": {"name": n}}, sort_keys=False)}
                for d in delete
            ],
        )

    def namespace(self) -> dict[str, Any]:
        """The Namespace (the base only names it: it may be an operator's, with its own quotas and policies)."""
        return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": self.options.namespace}}

    def servicemonitor(self) -> dict[str, Any]:
        """The Prometheus operator's ServiceMonitor of the server's ``metrics`` port."""
        return {
            "apiVersion": SERVICEMONITOR_API,
            "kind": "ServiceMonitor",
            "metadata": self.meta(f"{self.name}-server", "server"),
            "spec": {
                "selector": {"matchLabels": self.labels("server")},
                "namespaceSelector": {"matchNames": [self.options.namespace]},
                "endpoints": [{"port": "metrics", "path": "/metrics", "interval": "30s"}],
            },
        }


def overlay(resources: list[str], **fields: Any) -> dict[str, Any]:
    """A kustomization of ``resources`` (the base, and the overlay's own files)."""
    return {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": resources, **fields}
