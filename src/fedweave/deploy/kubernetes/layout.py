"""What every rendered deployment shares: the image, the paths and ports inside its pods, the
names of its objects and the options the command line adds to the config."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

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
HEARTBEAT_FILE = f"{SCRATCH}/fedweave-heartbeat"
"""The liveness file a client, site or worker touches while its loop runs (``FEDWEAVE_HEARTBEAT``)."""
PROBE_PERIOD = 10
"""Seconds between two probes of a pod."""
STARTUP_SECONDS = 600
"""How long a pod may take to start its loop (imports, data loading, the rendezvous) before its
startup probe fails; its liveness probe asks only from then on."""
CLIENT_PATIENCE = 600
"""Seconds a deployed client keeps retrying an unreachable server (``grpc.connect_timeout``, unless the
config sets it): a restarted server pod may take minutes (the kubelet's back-off, a reschedule)."""
RENDEZVOUS_PORT = 29500
PYTORCHJOB_API = "kubeflow.org/v1"
SERVICEMONITOR_API = "monitoring.coreos.com/v1"
ROLES = ("server", "client", "site", "worker")
"""The roles a pod plays, each with its own resources (``--cpu ROLE=...``)."""
ROLE_OF = {"server": "server", "client": "client", "site-leader": "site", "site-member": "site", "worker": "worker"}
"""The role of each ``app.kubernetes.io/component``."""
SCRAPER_LABEL = "fedweave.io/scraper"
"""The label (value ``"true"``) of the pods, in any namespace, the server's NetworkPolicy lets reach its
Prometheus port: put it on Prometheus' pods."""
GPU_RESOURCE = "nvidia.com/gpu"
GPU_NODE_SELECTOR = {"nvidia.com/gpu.present": "true"}  # the label NVIDIA's GPU feature discovery sets
NAME_LENGTH = 36
"""The longest deployment name: it takes suffixes such as ``-site-12-member-3`` within a DNS label."""


@dataclass(frozen=True)
class Options:
    """What the command line adds to the config."""

    image: str = IMAGE
    namespace: str = "default"
    cpu: str = "1"
    memory: str = "2Gi"
    storage: str = "1Gi"
    overrides: Sequence[str] = ()
    resources: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    """Per role (:data:`ROLES`): ``cpu`` and ``memory`` in place of the defaults above."""
    gpu_image: str | None = None
    """The image of the pods whose device is cuda (none: ``--image``'s tag with ``-cuda``)."""
    gpu_node_selector: Mapping[str, str] = field(default_factory=lambda: dict(GPU_NODE_SELECTOR))
    storage_class: str | None = None
    ephemeral_storage: str = "4Gi"
    tmp_size: str = "1Gi"
    external_host: str | None = None
    """A name outside the cluster reaches the server by: a LoadBalancer Service, in its certificate."""

    def resource(self, role: str, kind: str) -> str:
        return self.resources.get(role, {}).get(kind) or getattr(self, kind)


def k8s_name(text: str) -> str:
    """``text`` as a DNS-1123 label of at most :data:`NAME_LENGTH` characters; one cut to fit ends with a
    short hash of the whole ``text``, so two names that differ only past the cut stay apart."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    if len(name) > NAME_LENGTH:
        digest = hashlib.sha256(text.encode()).hexdigest()[:6]
        name = f"{name[: NAME_LENGTH - 7].rstrip('-')}-{digest}"
    return name or "fedweave"


def port_of(address: str) -> int:
    """The port of a ``host:port`` address."""
    return int(address.rpartition(":")[2])


@dataclass(frozen=True)
class ImageRef:
    """An image reference: by tag (``reg/fw:0.1.0``), by digest (``reg/fw@sha256:...``) or both."""

    name: str
    tag: str | None
    digest: str | None

    @classmethod
    def parse(cls, ref: str) -> ImageRef:
        named, _, digest = ref.partition("@")
        name, colon, tag = named.rpartition(":")
        if not colon or "/" in tag:
            name, tag = named, ""
        return cls(name, tag or None, digest or None)

    def cuda(self) -> str | None:
        """The CUDA build of a tagged image (``<tag>-cuda``, the Dockerfile's recipe); none for a digest."""
        return None if self.digest else f"{self.name}:{self.tag or 'latest'}-cuda"


QUANTITY = re.compile(r"^(?P<number>[0-9]+(\.[0-9]+)?)(?P<unit>m|k|M|G|T|Ki|Mi|Gi|Ti)?$")
UNITS = {None: 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30,
         "Ti": 2**40}
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
DNS_NAME = re.compile(r"^(?=.{1,253}$)[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?(\.[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?)*$")
IMAGE_REF = re.compile(
    r"^[a-z0-9]+([._-][a-z0-9]+)*(:[0-9]+)?(/[a-z0-9]+([._-]+[a-z0-9]+)*)*"  # [registry[:port]/]path
    r"(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[0-9a-f]{64})?$"  # [:tag][@digest]
)


def quantity(value: str) -> float:
    """The amount a Kubernetes quantity names (bytes for a size)."""
    m = QUANTITY.match(value)
    assert m is not None
    return float(m["number"]) * UNITS[m["unit"]]


def check_options(options: Options) -> None:
    """One line for a command-line value Kubernetes would refuse."""
    quantities = [("--cpu", options.cpu), ("--memory", options.memory), ("--storage", options.storage),
                  ("--ephemeral-storage", options.ephemeral_storage), ("--tmp-size", options.tmp_size)]
    for role, values in options.resources.items():
        if role not in ROLES:
            raise ConfigError(f"fedweave deploy k8s: --cpu/--memory {role}=...: no role {role!r} "
                              f"(one of {', '.join(ROLES)})")
        quantities += [(f"--{kind} {role}=", value) for kind, value in values.items()]
    for flag, value in quantities:
        if not QUANTITY.match(value):
            raise ConfigError(f"fedweave deploy k8s: {flag} {value!r} is not a Kubernetes quantity (e.g. 500m, 2, 4Gi)")
    if quantity(options.tmp_size) > quantity(options.ephemeral_storage):
        raise ConfigError(f"fedweave deploy k8s: --tmp-size {options.tmp_size} exceeds --ephemeral-storage "
                          f"{options.ephemeral_storage} (the /tmp emptyDir counts against it)")
    if not DNS_LABEL.match(options.namespace):
        raise ConfigError(
            f"fedweave deploy k8s: --namespace {options.namespace!r} is not a DNS label (lower case letters, digits, '-')"
        )
    for flag, image in (("--image", options.image), ("--gpu-image", options.gpu_image)):
        if image is not None and not IMAGE_REF.match(image):
            raise ConfigError(f"fedweave deploy k8s: {flag} {image!r} is not an image reference "
                              "(REGISTRY/NAME:TAG or REGISTRY/NAME@sha256:DIGEST)")
    for flag, name in (("--storage-class", options.storage_class), ("--external-host", options.external_host)):
        if name is not None and not DNS_NAME.match(name):
            raise ConfigError(f"fedweave deploy k8s: {flag} {name!r} is not a DNS name")
