"""``fedweave deploy federation [FED.yaml] --site SITE.yaml ... --out DIR``: the federation service on Kubernetes.

A kustomize base (``kubectl apply -k DIR/base``; ``DIR/overlays/namespace`` also creates the namespace):

- the federation server (``fedweave federation serve /etc/fedweave/federation.yaml``) as a Deployment of one
  replica replaced with the Recreate strategy: it never finishes, and one pod at a time writes its job store,
  a PersistentVolumeClaim mounted at ``/var/lib/fedweave``; the kubelet's ``grpc`` probes ask its plaintext
  health port; a Service of the federation port and of each port of ``job_ports`` (``job-<port>``), the
  ports its jobs' servers bind, FED.yaml's ``job_host`` set to that Service (required: without fixed
  ports no site could reach a job); a NetworkPolicy that admits the federation port from anywhere (sites
  and admins, in the cluster or outside: mutual TLS and the admin role guard it), the job ports from the
  sites' pods, and lets it reach only the DNS;
- each site (``fedweave federation join /etc/fedweave/site.yaml``) as a Deployment of its own: its
  credentials from its own Secret, its working folder (the jobs' folders, its audit log) on its own claim,
  its catalogue's data read-only from a claim of its own or the one the operator names, or a hostPath
  folder; a NetworkPolicy that admits nothing and lets it reach the DNS, the federation port and the
  job ports only.

Without FED.yaml the sites join an external federation: their ``server`` key is kept and their pods
may reach that port, and the external federation's ``job_ports`` (``--job-ports``), on any host. The
files the pods read are the operator's with the paths of the pods on top (:data:`FED_PATHS`, :data:`SITE_PATHS`); a catalogue entry's relative path is the same path
under the data volume (an absolute one must lie under the hostPath folder given).

Credentials are the folders the files name (``credentials``), copied into ``DIR/base/credentials/`` as
the Secrets' sources; a differing file already there is kept unless ``force``.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from fedweave.config import Config, LocalConfig, read_yaml
from fedweave.deploy.kubernetes.layout import (
    CREDENTIALS_DIR,
    DATA_DIR,
    DNS_LABEL,
    HEALTH_PORT,
    IMAGE,
    QUANTITY,
    Options,
    check_options,
    k8s_name,
    port_of,
)
from fedweave.deploy.kubernetes.manifests import Manifests, overlay
from fedweave.deploy.kubernetes.render import Rendered, write_base, write_file, write_kustomization
from fedweave.errors import ConfigError
from fedweave.federation.config import check_job_ports
from fedweave.federation.ports import parse_ports
from fedweave.transports.grpc import certs
from fedweave.files import atomic_write_bytes

FEDERATION_FILE = "/etc/fedweave/federation.yaml"
SITE_FILE = "/etc/fedweave/site.yaml"
STORE_DIR = f"{DATA_DIR}/store"
WORK_DIR = f"{DATA_DIR}/work"
SITE_DATA_DIR = f"{DATA_DIR}/data"
FED_PATHS = {"store": STORE_DIR, "credentials": CREDENTIALS_DIR}
"""The keys of FED.yaml set to the pod's paths (``listen`` and ``health_listen`` are set to its ports,
``job_host`` to its Service)."""
SITE_PATHS = {"workdir": WORK_DIR, "credentials": CREDENTIALS_DIR}
"""The keys of SITE.yaml set to the pod's paths (``server`` to the federation's Service, in the cluster)."""
COMMAND = "fedweave deploy federation"


@dataclass(frozen=True)
class SiteData:
    """Where a site's catalogue data comes from: an existing claim, a host folder, or (neither) a new claim."""

    claim: str | None = None
    host_path: str | None = None

    @classmethod
    def parse(cls, text: str) -> tuple[str, SiteData]:
        """``SITE=claim:NAME`` or ``SITE=host:/PATH`` (``--site-data``)."""
        site, sep, where = text.partition("=")
        kind, colon, value = where.partition(":")
        if not sep or not colon or not value or kind not in ("claim", "host"):
            raise ConfigError(f"{COMMAND}: --site-data {text!r} is not SITE=claim:NAME or SITE=host:/PATH")
        if kind == "host" and not PurePosixPath(value).is_absolute():
            raise ConfigError(f"{COMMAND}: --site-data {text!r}: a hostPath folder is absolute")
        return site, cls(claim=value) if kind == "claim" else cls(host_path=value)


@dataclass(frozen=True)
class FederationOptions:
    """What the command line adds: the run deployment's :class:`Options` and the federation's own."""

    base: Options = field(default_factory=Options)
    site_data: Mapping[str, SiteData] = field(default_factory=dict)
    data_storage: str = "10Gi"
    """The size of a site's new data claim (no ``--site-data``)."""
    force: bool = False
    job_ports: str | None = None
    """An external federation's ``job_ports`` (no FED.yaml), which its sites' pods may reach."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``fedweave deploy federation``."""
    parser.add_argument("federation", nargs="?", help="FED.yaml of the federation server (none: the sites join "
                        "an external federation, at their files' server)")
    parser.add_argument("--site", action="append", default=[], metavar="SITE.yaml", help="a site to deploy (repeat)")
    parser.add_argument("--out", required=True, metavar="DIR", help="folder to write base/ and overlays/ into")
    parser.add_argument("--image", default=IMAGE, metavar="IMG", help=f"container image (default {IMAGE})")
    parser.add_argument("--gpu-image", metavar="IMG", help="image of the sites whose device is cuda "
                        "(default: --image's tag with -cuda)")
    parser.add_argument("--namespace", default="default", metavar="NS", help="namespace (default: default)")
    parser.add_argument("--cpu", default="1", help="CPU request and limit of each pod (default 1)")
    parser.add_argument("--memory", default="2Gi", help="memory request and limit of each pod (default 2Gi)")
    parser.add_argument("--storage", default="1Gi", help="size of the job store's claim and each site's "
                        "working folder's (default 1Gi)")
    parser.add_argument("--storage-class", metavar="CLASS", help="storage class of the claims (default: the cluster's)")
    parser.add_argument("--site-data", action="append", default=[], metavar="SITE=claim:NAME|SITE=host:/PATH",
                        help="a site's catalogue data: an existing claim or a node's folder (default: a new claim "
                        "of --data-storage the operator fills, its layout the site file's folder's)")
    parser.add_argument("--data-storage", default="10Gi", metavar="SIZE", help="size of a new data claim (default 10Gi)")
    parser.add_argument("--job-ports", metavar="LOW-HIGH", help="without FED.yaml: the external federation's "
                        "job_ports, which the sites' pods may reach on any host")
    parser.add_argument("--force", action="store_true", help="replace credentials that differ in DIR/base/credentials")


def render_args(args: argparse.Namespace) -> Rendered:
    """``fedweave deploy federation`` with parsed ``args``."""
    base = Options(image=args.image, gpu_image=args.gpu_image, namespace=args.namespace, cpu=args.cpu,
                   memory=args.memory, storage=args.storage, storage_class=args.storage_class)
    site_data = dict(SiteData.parse(text) for text in args.site_data)
    options = FederationOptions(base, site_data, args.data_storage, args.force, args.job_ports)
    return render(args.federation, args.site, args.out, options)


def _read(path: str | Path, what: str) -> dict[str, Any]:
    if not Path(path).is_file():
        raise ConfigError(f"{COMMAND}: no {what} file {str(path)!r}")
    data = read_yaml(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{what} file {str(path)!r}: expected a mapping of keys")
    return data


def _job_ports(fed: Mapping[str, Any], port: int, health: int, where: str) -> range:
    """FED.yaml's ``job_ports``, required on Kubernetes: a Service and NetworkPolicies open fixed ports only."""
    if fed.get("job_ports") is None:
        raise ConfigError(f"{where}: config key 'job_ports' is required on Kubernetes (LOW-HIGH, e.g. 7400-7409): "
                          "the ports the Service opens for the jobs' servers")
    jobs = fed.get("max_concurrent_jobs", 1)
    try:
        return check_job_ports(fed["job_ports"], jobs if isinstance(jobs, int) else 1,
                               [f"0.0.0.0:{port}", f"0.0.0.0:{health}"])
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _port(data: Mapping[str, Any], keys: Sequence[str], where: str) -> int:
    """The port of the first of ``keys`` set in ``data`` (a ``host:port``)."""
    for key in keys:
        value = data.get(key)
        if value is not None:
            if not isinstance(value, str) or not value.rpartition(":")[2].isdigit():
                raise ConfigError(f"{where}: config key {key!r}: expected host:port, got {value!r}")
            return port_of(value)
    raise ConfigError(f"{where}: config key {keys[0]!r} is required (host:port)")


class _Parts:
    """The building blocks of :class:`~fedweave.deploy.kubernetes.manifests.Manifests` for pods of one device."""

    def __init__(self, name: str, options: Options, device: str = "cpu"):
        self.k = Manifests(Config(local=LocalConfig(device=device)), name, options)

    def pod(self, component: str, role: str, args: list[str], config_map: str, file: str,
            mounts: list[dict[str, Any]], volumes: list[dict[str, Any]],
            ports: list[dict[str, Any]] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(container, pod spec)`` of a long-lived pod reading ``file`` from ConfigMap ``config_map``."""
        k = self.k
        container = k.container(component, role, args, mounts, ports=ports)
        container["volumeMounts"][0] = {"name": "config", "mountPath": file, "subPath": PurePosixPath(file).name,
                                        "readOnly": True}
        spec = k.pod_spec(role, container, volumes, "Always")
        spec["volumes"][0] = {"name": "config", "configMap": {"name": config_map}}
        return container, spec

    def deployment(self, name: str, component: str, spec: dict[str, Any], extra: dict[str, str]) -> dict[str, Any]:
        meta = self.k.meta(name, component, extra)
        return {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": meta,
            "spec": {
                "replicas": 1,
                # never two pods at once: one writer of the job store, one agent per site identity
                "strategy": {"type": "Recreate"},
                "selector": {"matchLabels": meta["labels"]},
                "template": {"metadata": {"labels": meta["labels"]}, "spec": spec},
            },
        }

    def claim(self, name: str, component: str, size: str, extra: dict[str, str] | None = None) -> dict[str, Any]:
        body = self.k.claim(component, "ReadWriteOnce")
        body["metadata"] = self.k.meta(name, component, extra)
        body["spec"]["resources"]["requests"]["storage"] = size
        return body


def _site_file(data: dict[str, Any], source: Path, server: str | None, data_root: SiteData) -> dict[str, Any]:
    """The site file a site's pod reads: the operator's with the pod's paths on top."""
    site = copy.deepcopy(data)
    site.update(SITE_PATHS)
    if server is not None:
        site["server"] = server
    catalog = site.get("catalog") or {}
    if not isinstance(catalog, dict):
        raise ConfigError(f"site file {str(source)!r}: config key 'catalog': expected a mapping of entries")
    for entry, spec in catalog.items():
        path = spec.get("path") if isinstance(spec, dict) else None
        if not isinstance(path, str) or not path:
            raise ConfigError(f"site file {str(source)!r}: config key 'catalog.{entry}.path' is required")
        posix = PurePosixPath(path)
        if posix.is_absolute():
            root = data_root.host_path
            if root is None or not posix.is_relative_to(root):
                raise ConfigError(
                    f"site file {str(source)!r}: config key 'catalog.{entry}.path': {path} is absolute; make it "
                    "relative to the site file's folder (the data volume holds the same layout), or give "
                    "--site-data SITE=host:FOLDER holding it"
                )
            posix = posix.relative_to(root)
        if ".." in posix.parts:
            raise ConfigError(f"site file {str(source)!r}: config key 'catalog.{entry}.path': {path} leaves the data volume")
        spec["path"] = str(PurePosixPath(SITE_DATA_DIR) / posix)
    return site


def _credentials(data: Mapping[str, Any], source: Path, folder: Path, force: bool, needed: Sequence[str]) -> list[str]:
    """Copy the files ``needed`` (the CA's certificate, this node's own certificate and key) of ``data``'s
    ``credentials`` folder into ``folder``; their names (the Secret's keys). Nothing else of the folder travels:
    a folder of `fedweave certs` also holds the CA's key and every other node's key."""
    given = data.get("credentials")
    if not isinstance(given, str):
        raise ConfigError(f"{source}: config key 'credentials' is required (the folder of this node's TLS files)")
    origin = Path(given) if Path(given).is_absolute() else source.parent / given
    if not origin.is_dir():
        raise ConfigError(f"{source}: config key 'credentials': no folder {str(origin)!r}")
    names = sorted(needed)
    for name in names:
        if not (origin / name).is_file() or (origin / name).is_symlink():
            raise ConfigError(f"{source}: config key 'credentials': no file {name!r} in {str(origin)!r}")
    contents = {name: (origin / name).read_bytes() for name in names}
    for name, content in contents.items():  # every file checked before one is written
        target = folder / name
        if target.exists() and target.read_bytes() != content and not force:
            raise ConfigError(
                f"{COMMAND}: {target} differs from {origin / name}; kept (pass --force to replace a credential)"
            )
    folder.mkdir(parents=True, exist_ok=True)
    for name, content in contents.items():
        atomic_write_bytes(content, folder / name, private=True)
    return names


def render(federation: str | Path | None, sites: Sequence[str | Path], out: str | Path,
           options: FederationOptions = FederationOptions()) -> Rendered:
    """Write the kustomize base (and the namespace overlay) of the federation server at ``federation``
    (None: none, the sites join an external one) and the sites ``sites`` into ``out``."""
    if federation is None and not sites:
        raise ConfigError(f"{COMMAND}: nothing to deploy; give FED.yaml, --site SITE.yaml, or both")
    o = options.base
    check_options(o)
    if not QUANTITY.match(options.data_storage):
        raise ConfigError(f"{COMMAND}: --data-storage {options.data_storage!r} is not a Kubernetes quantity (e.g. 10Gi)")
    out = Path(out)
    base = out / "base"
    credentials = base / "credentials"
    fed = _read(federation, "federation") if federation is not None else None
    name = k8s_name(str((fed or {}).get("name") or "federation"))
    parts = _Parts(name, o)
    k = parts.k
    files: dict[str, list[dict[str, Any]]] = {}
    config_maps: list[dict[str, Any]] = []
    secrets: list[dict[str, Any]] = []
    result = Rendered(out, name)
    server_address = None
    port = None
    job_ports = range(0)
    if options.job_ports is not None:
        if fed is not None:
            raise ConfigError(f"{COMMAND}: --job-ports is for sites of an external federation; with FED.yaml "
                              "its config key 'job_ports' says them")
        job_ports = parse_ports(options.job_ports, f"{COMMAND}: --job-ports")
    if fed is not None:
        assert federation is not None
        where = f"federation file {str(federation)!r}"
        port = _port(fed, ("listen", "address"), where)
        health = port_of(fed["health_listen"]) if isinstance(fed.get("health_listen"), str) else HEALTH_PORT
        if health == port:
            raise ConfigError(f"{where}: config key 'health_listen': port {health} is the federation's; the "
                              "plaintext health port needs one of its own")
        job_ports = _job_ports(fed, port, health, where)
        deployed = {**fed, **FED_PATHS, "listen": f"0.0.0.0:{port}", "health_listen": f"0.0.0.0:{health}",
                    "job_host": f"{name}-server"}
        write_file(yaml.safe_dump(deployed, sort_keys=False), base / "federation.yaml")
        config_maps.append({"name": f"{name}-federation", "files": ["federation.yaml"]})
        names = _credentials(fed, Path(federation), credentials / "server", options.force,
                             [certs.CA_CERT, certs.SERVER_CERT, certs.SERVER_KEY])
        secrets.append({"name": f"{name}-server", "type": "Opaque", "files": [f"credentials/server/{n}" for n in names]})
        server_address = f"{name}-server:{port}"
        volume, mount = k.secret_volume("server")
        store = {"name": "store", "persistentVolumeClaim": {"claimName": f"{name}-store"}}
        container, spec = parts.pod(
            "server", "server", ["federation", "serve", FEDERATION_FILE], f"{name}-federation", FEDERATION_FILE,
            [mount, {"name": "store", "mountPath": DATA_DIR}], [volume, store],
            ports=[{"name": "grpc", "containerPort": port, "protocol": "TCP"},
                   {"name": "health", "containerPort": health, "protocol": "TCP"},
                   *({"name": f"job-{p}", "containerPort": p, "protocol": "TCP"} for p in job_ports)],
        )
        probe = {"grpc": {"port": health}, "periodSeconds": 10, "timeoutSeconds": 2}
        container["readinessProbe"] = {**probe, "failureThreshold": 3}
        container["livenessProbe"] = {**probe, "initialDelaySeconds": 30, "failureThreshold": 6}
        selector = k.labels("server")
        files["server.yaml"] = [
            parts.claim(f"{name}-store", "server", o.storage),
            parts.deployment(f"{name}-server", "server", spec, {}),
            {"apiVersion": "v1", "kind": "Service", "metadata": k.meta(f"{name}-server", "server"),
             "spec": {"selector": selector,
                      "ports": [{"name": "grpc", "port": port, "targetPort": "grpc", "protocol": "TCP"},
                                *({"name": f"job-{p}", "port": p, "targetPort": f"job-{p}", "protocol": "TCP"}
                                  for p in job_ports)]}},
            k.policy(f"{name}-server", "server", {"matchLabels": selector},
                     [{"ports": [{"port": port, "protocol": "TCP"}]},
                      {"from": [{"podSelector": {"matchLabels": k.labels("site")}}],
                       "ports": [{"port": p, "protocol": "TCP"} for p in job_ports]}], []),
        ]
    site_objects: list[dict[str, Any]] = []
    seen: dict[str, str] = {}
    for path in sites:
        data = _read(path, "site")
        source = Path(path)
        site_name = data.get("name")
        if not isinstance(site_name, str) or not site_name:
            raise ConfigError(f"site file {str(path)!r}: config key 'name' is required (the site's identity)")
        label = k8s_name(site_name)
        if not DNS_LABEL.match(label) or label in seen:
            raise ConfigError(f"site file {str(path)!r}: config key 'name': {site_name!r} gives the same object "
                              f"names as site {seen.get(label)!r}")
        seen[label] = site_name
        node = f"site-{label}"
        data_root = options.site_data.get(site_name, SiteData())
        deployed = _site_file(data, source, server_address, data_root)
        external = server_address is None
        site_port = _port(deployed, ("server",), f"site file {str(path)!r}") if external else port
        write_file(yaml.safe_dump(deployed, sort_keys=False), base / f"{node}.yaml")
        config_maps.append({"name": f"{name}-{node}", "files": [f"site.yaml={node}.yaml"]})
        stem = certs.identity_name("site", site_name)
        names = _credentials(data, source, credentials / node, options.force,
                             [certs.CA_CERT, certs.cert_file(stem), certs.key_file(stem)])
        secrets.append({"name": f"{name}-{node}", "type": "Opaque", "files": [f"credentials/{node}/{n}" for n in names]})
        device = str(data.get("device") or "cpu")
        site_parts = _Parts(name, o, device)
        volume, mount = site_parts.k.secret_volume(node)
        extra = {"fedweave.io/site": label}
        claims = [site_parts.claim(f"{name}-{node}-work", "site", o.storage, extra)]
        if data_root.host_path is not None:
            data_volume = {"name": "data", "hostPath": {"path": data_root.host_path, "type": "Directory"}}
            result.notes.append(f"site {site_name}: a hostPath volume needs a namespace whose Pod Security level "
                                "admits it (privileged; restricted and baseline refuse hostPath)")
        else:
            claim = data_root.claim or f"{name}-{node}-data"
            data_volume = {"name": "data", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
            if data_root.claim is None:
                claims.append(site_parts.claim(claim, "site", options.data_storage, extra))
                result.notes.append(f"site {site_name}: fill claim {claim} with its catalogue's data (the layout "
                                    f"of {source.parent}) before it runs a job")
        _, spec = site_parts.pod(
            "site", "client", ["federation", "join", SITE_FILE], f"{name}-{node}", SITE_FILE,
            [mount, {"name": "work", "mountPath": WORK_DIR},
             {"name": "data", "mountPath": SITE_DATA_DIR, "readOnly": True}],
            [volume, {"name": "work", "persistentVolumeClaim": {"claimName": f"{name}-{node}-work"}}, data_volume],
        )
        reach: dict[str, Any] = {"ports": [{"port": p, "protocol": "TCP"} for p in (site_port, *job_ports)]}
        if not external:
            reach["to"] = [{"podSelector": {"matchLabels": k.labels("server")}}]
        site_objects += [
            *claims,
            site_parts.deployment(f"{name}-{node}", "site", spec, extra),
            k.policy(f"{name}-{node}", "site", {"matchLabels": {**k.labels("site"), **extra}}, [], [reach]),
        ]
    if site_objects:
        files["sites.yaml"] = site_objects
    write_file("# private keys and tokens: never commit them\n*\n", credentials / ".gitignore")
    result.kustomizations.append(write_base(base, files, o.namespace, k.labels(), config_maps, secrets))
    if o.namespace != "default":
        folder = out / "overlays" / "namespace"
        write_file(yaml.safe_dump(k.namespace(), sort_keys=False), folder / "namespace.yaml")
        result.kustomizations.append(write_kustomization(folder, overlay(["namespace.yaml", "../../base"])))
    return result
