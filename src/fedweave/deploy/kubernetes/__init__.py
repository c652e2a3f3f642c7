"""Kubernetes manifests for a config: ``fedweave deploy k8s CONFIG --out DIR``.

Writes a kustomize base and its overlays (``kubectl apply -k DIR/base`` or an overlay):

================================  ========================================================
``DIR/base/``                     ``kustomization.yaml``; ``config.yaml`` (the ConfigMap every pod
                                  mounts); ``credentials/`` (``fedweave certs``' files, the source
                                  of the Secrets: each pod mounts its own); the workloads and
                                  their NetworkPolicies
``DIR/overlays/namespace/``       (``--namespace`` other than default) the base and its Namespace
``DIR/overlays/servicemonitor/``  (``observe.prometheus_port``) the base and a ServiceMonitor of the
                                  Prometheus operator
``DIR/overlays/pytorchjob/``      (``mode: data_parallel``) a Kubeflow PyTorchJob with an
                                  elasticPolicy in place of the Indexed Job
================================  ========================================================

The workloads follow the config: a federated star is the server (a Job restarted on failure,
which resumes from its run directory, a Service, the PersistentVolumeClaim of that run
directory) and one Job per client; a hierarchical gRPC deployment has the same server and, per
top-level site, a leader Job, a headless Service for the site's torch.distributed rendezvous and
one Job per member; ``mode: data_parallel`` is an Indexed Job of torchrun pods, the headless
Service of its rendezvous and the PersistentVolumeClaim (ReadWriteMany) of the run directory they
share. Each client (and site leader) is a Job of its own rather than a pod of one StatefulSet or
Indexed Job, because pods of one template mount the same volumes: only a pod of its own can hold a
key that no other client can read.

Every pod is under a NetworkPolicy that admits only the job's own pods (the server's port: its
clients and site leaders, or anyone with ``--external-host``; a site's or the workers'
unauthenticated torch.distributed ports: the site's or the job's pods; the Prometheus port: pods
labelled ``fedweave.io/scraper: "true"``) and lets it reach only the cluster's DNS and the pods it
talks to. Pods whose device is cuda (``local.device``; workers also with ``data_parallel.backend:
nccl``) take the CUDA image, one GPU, the GPU nodes' toleration and node selector.

The deployed config is the user's with the deployment's settings on top: the server's
Service name as ``grpc.address``, credentials at their mount path, mutual TLS and tokens on
(unless the command's own overrides say otherwise), clients that wait ten minutes for a
restarted server (unless the config sets ``grpc.connect_timeout``), and the plaintext health port
(``grpc.health_listen``) the kubelet's ``grpc`` probes ask, since they cannot present a
client certificate. Credentials already in ``DIR/base/credentials`` are kept, so rendering
again does not change any key.

The package: :mod:`~fedweave.deploy.kubernetes.layout` (paths, ports, names, options),
:mod:`~fedweave.deploy.kubernetes.manifests` (the objects),
:mod:`~fedweave.deploy.kubernetes.render` (the command: config, credentials, files).
"""

from fedweave.deploy.kubernetes.layout import (
    CLIENT_PATIENCE,
    CONFIG_PATH,
    CREDENTIALS_DIR,
    DATA_DIR,
    KUBERNETES_VERSION,
    RUN_DIR,
    SCRAPER_LABEL,
    UID,
    ImageRef,
    Options,
    k8s_name,
)
from fedweave.deploy.kubernetes.render import Rendered, add_arguments, deployed_config, emulated, render, render_args

__all__ = [
    "CLIENT_PATIENCE",
    "CONFIG_PATH",
    "CREDENTIALS_DIR",
    "DATA_DIR",
    "KUBERNETES_VERSION",
    "RUN_DIR",
    "SCRAPER_LABEL",
    "UID",
    "ImageRef",
    "Options",
    "Rendered",
    "add_arguments",
    "deployed_config",
    "emulated",
    "k8s_name",
    "render",
    "render_args",
]
