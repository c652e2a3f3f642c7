"""What every rendered deployment shares: the image, the paths and ports inside its pods, the
names of its objects and the options the command line adds to the config."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from fedweave import __version__
from fedweave.errors import ConfigError

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


def k8s_name(text: str) -> str:
    """``text`` as a DNS-1123 label short enough to take suffixes such as ``-site-12-member-3``."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:36].strip("-")
    return name or "fedweave"


def port_of(address: str) -> int:
    """The port of a ``host:port`` address."""
    return int(address.rpartition(":")[2])


QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|Ki|Mi|Gi|Ti)?$")
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def check_options(options: Options) -> None:
    """One line for a command-line value Kubernetes would refuse."""
    for flag, value in (("--cpu", options.cpu), ("--memory", options.memory), ("--storage", options.storage)):
        if not QUANTITY.match(value):
            raise ConfigError(f"fedweave deploy k8s: {flag} {value!r} is not a Kubernetes quantity (e.g. 500m, 2, 4Gi)")
    if not DNS_LABEL.match(options.namespace):
        raise ConfigError(
            f"fedweave deploy k8s: --namespace {options.namespace!r} is not a DNS label (lower case letters, digits, '-')"
        )
    if not options.image or any(ch.isspace() for ch in options.image):
        raise ConfigError(f"fedweave deploy k8s: --image {options.image!r} is not an image reference")
