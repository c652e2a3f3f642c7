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
    UID,
    Options,
    k8s_name,
)
from fedweave.deploy.kubernetes.render import Rendered, add_arguments, deployed_config, render, render_args

__all__ = [
    "CLIENT_PATIENCE",
    "CONFIG_PATH",
    "CREDENTIALS_DIR",
    "DATA_DIR",
    "KUBERNETES_VERSION",
    "RUN_DIR",
    "UID",
    "Options",
    "Rendered",
    "add_arguments",
    "deployed_config",
    "k8s_name",
    "render",
    "render_args",
]
