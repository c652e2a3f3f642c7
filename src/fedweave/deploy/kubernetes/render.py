"""``fedweave deploy k8s``: the deployed config, the credentials and the kustomize folders written."""

from __future__ import annotations

import argparse
import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fedweave import config as config_mod
from fedweave.config import Config
from fedweave.deploy.kubernetes.layout import (
    CLIENT_PATIENCE,
    CONFIG_FILE,
    CREDENTIALS_DIR,
    GPU_NODE_SELECTOR,
    HEALTH_PORT,
    IMAGE,
    ROLES,
    Options,
    check_options,
    k8s_name,
    port_of,
)
from fedweave.deploy.kubernetes.manifests import Manifests, overlay
from fedweave.errors import ConfigError
from fedweave.files import atomic_write_text
from fedweave.transports.grpc import certs


@dataclass
class Rendered:
    out: Path
    name: str
    kustomizations: list[Path] = field(default_factory=list)  # base first, then the overlays
    notes: list[str] = field(default_factory=list)  # one line each: what the operator must know before applying


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``fedweave deploy k8s``."""
    parser.add_argument("config", help="YAML config file of the run to deploy")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rounds=50 grpc.tls=tls")
    parser.add_argument("--out", required=True, metavar="DIR", help="folder to write base/ and overlays/ into")
    parser.add_argument("--image", default=IMAGE, metavar="IMG",
                        help=f"container image, by tag or by digest (REGISTRY/NAME@sha256:...; default {IMAGE})")
    parser.add_argument("--gpu-image", metavar="IMG", help="image of the pods whose device is cuda "
                        "(default: --image's tag with -cuda; needed when --image is a digest)")
    parser.add_argument("--namespace", default="default", metavar="NS",
                        help="namespace (default: default); overlays/namespace creates it")
    parser.add_argument("--cpu", action="append", metavar="[ROLE=]CPU",
                        help=f"CPU request and limit of each pod (default 1); ROLE=CPU for one role ({', '.join(ROLES)})")
    parser.add_argument("--memory", action="append", metavar="[ROLE=]MEM",
                        help="memory request and limit of each pod (default 2Gi); ROLE=MEM for one role")
    parser.add_argument("--ephemeral-storage", default="4Gi", metavar="SIZE",
                        help="ephemeral-storage request and limit of each pod (default 4Gi)")
    parser.add_argument("--tmp-size", default="1Gi", metavar="SIZE",
                        help="size limit of the /tmp emptyDir, within --ephemeral-storage (default 1Gi)")
    parser.add_argument("--storage", default="1Gi", help="size of the run-directory volume (default 1Gi)")
    parser.add_argument("--storage-class", metavar="CLASS",
                        help="storage class of the run-directory claim (default: the cluster's default)")
    parser.add_argument("--gpu-node-selector", action="append", metavar="KEY=VALUE",
                        help="node label of the GPU nodes the cuda pods go to (default nvidia.com/gpu.present=true)")
    parser.add_argument("--external-host", metavar="NAME",
                        help="DNS name clients outside the cluster reach the server by: a LoadBalancer Service, "
                        "and a server certificate valid for it")


def _per_role(flag: str, values: list[str] | None, default: str) -> tuple[str, dict[str, str]]:
    """``--cpu 2 --cpu server=4``: the default and the value per role."""
    roles: dict[str, str] = {}
    for value in values or []:
        role, sep, amount = value.rpartition("=")
        if sep:
            roles[role] = amount
        else:
            default = amount
    return default, roles


def render_args(args: argparse.Namespace) -> Rendered:
    """``fedweave deploy k8s`` with parsed ``args``."""
    cpu, cpus = _per_role("--cpu", args.cpu, "1")
    memory, memories = _per_role("--memory", args.memory, "2Gi")
    resources: dict[str, dict[str, str]] = {}
    for kind, per_role in (("cpu", cpus), ("memory", memories)):
        for role, amount in per_role.items():
            resources.setdefault(role, {})[kind] = amount
    selector = dict(GPU_NODE_SELECTOR)
    if args.gpu_node_selector:
        selector = {}
        for item in args.gpu_node_selector:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise ConfigError(f"fedweave deploy k8s: --gpu-node-selector {item!r} is not KEY=VALUE")
            selector[key] = value
    options = Options(
        image=args.image, namespace=args.namespace, cpu=cpu, memory=memory, storage=args.storage,
        overrides=tuple(args.overrides), resources=resources, gpu_image=args.gpu_image,
        gpu_node_selector=selector, storage_class=args.storage_class, ephemeral_storage=args.ephemeral_storage,
        tmp_size=args.tmp_size, external_host=args.external_host,
    )
    return render(args.config, args.out, options)


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
    port = port_of(user.grpc.address)
    health = port_of(user.grpc.health_listen) if user.grpc.health_listen else HEALTH_PORT
    if health == port:
        raise ConfigError(f"config key 'grpc.health_listen': port {health} is the federation's (grpc.address); "
                          "the plaintext health port needs one of its own")
    if user.observe.prometheus_port in (port, health):
        raise ConfigError(f"config key 'observe.prometheus_port': port {user.observe.prometheus_port} is taken by "
                          "the federation or its health port")
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


def emulated(config: Config) -> list[str]:
    """The keys of ``heterogeneity`` that emulate unlike machines on one (by sleeping, killing, joining)."""
    h = config.heterogeneity
    keys = [key for key in ("speeds", "speed_range", "schedule", "crashes", "joins") if getattr(h, key)]
    return [*keys, "slowdown"] if h.slowdown != 1 else keys


def render(path: str | Path, out: str | Path, options: Options | None = None) -> Rendered:
    """Write the kustomize base and overlays for the config at ``path`` into ``out``."""
    options = options if options is not None else Options()
    if not Path(path).is_file():
        raise ConfigError(f"fedweave deploy k8s: no config file {str(path)!r}")
    check_options(options)
    data, config, name = deployed_config(path, options)
    k = Manifests(config, name, options)
    components = ["worker"] if config.mode == "data_parallel" else ["client", "site-leader", "site-member"]
    if any(k.device(c) == "cuda" for c in components) and k.cuda_image() is None:
        raise ConfigError(f"fedweave deploy k8s: --image {options.image} is a digest: name the image of the cuda "
                          "pods with --gpu-image")
    out = Path(out)
    base = out / "base"
    result = Rendered(out, name)
    files: dict[str, list[dict[str, Any]]] = {}
    secrets: dict[str, list[str]] = {}
    if config.mode == "data_parallel":
        files["workers.yaml"] = k.workers()
        result.notes.append(
            f"the run directory's claim {name}-run is ReadWriteMany (every worker pod mounts it): its storage class "
            f"({options.storage_class or 'the cluster default'}) must offer that, e.g. NFS or CephFS"
        )
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
        hosts = _server_hosts(name, options.namespace, options.external_host)
        _credentials(base / "credentials", config.clients, sites, hosts, secrets)
        if options.external_host is not None:
            result.notes.append(
                f"clients outside the cluster: point {options.external_host} at the external IP of Service "
                f"{name}-server-external and start `fedweave client CONFIG --id N --address "
                f"{options.external_host}:{k.port}` with credentials/client-N.*"
            )
    if emulated(config):
        result.notes.append(
            f"warning: heterogeneity.{', heterogeneity.'.join(emulated(config))} emulate unlike machines (the pods "
            "sleep, or are killed); unset them to deploy on real ones"
        )
    write_file(yaml.safe_dump(data, sort_keys=False), base / CONFIG_FILE)
    generated = [
        {"name": secret, "type": "Opaque", "files": [f"credentials/{f}" for f in names]}
        for secret, names in secrets.items()
    ]
    config_maps = [{"name": f"{name}-config", "files": [CONFIG_FILE]}]
    result.kustomizations.append(write_base(base, files, options.namespace, k.labels(), config_maps, generated))
    overlays = out / "overlays"
    if options.namespace != "default":
        write_file(yaml.safe_dump(k.namespace(), sort_keys=False), overlays / "namespace" / "namespace.yaml")
        result.kustomizations.append(
            write_kustomization(overlays / "namespace", overlay(["namespace.yaml", "../../base"]))
        )
    if k.metrics_port is not None:
        write_file(yaml.safe_dump(k.servicemonitor(), sort_keys=False), overlays / "servicemonitor" / "servicemonitor.yaml")
        result.kustomizations.append(
            write_kustomization(overlays / "servicemonitor", overlay(["../../base", "servicemonitor.yaml"]))
        )
    if config.mode == "data_parallel":
        write_file(yaml.safe_dump(k.pytorchjob(), sort_keys=False), overlays / "pytorchjob" / "pytorchjob.yaml")
        result.kustomizations.append(write_kustomization(overlays / "pytorchjob", k.pytorchjob_overlay()))
    return result


def write_base(
    base: Path,
    files: Mapping[str, list[dict[str, Any]]],
    namespace: str,
    labels: dict[str, str],
    config_maps: list[dict[str, Any]],
    secrets: list[dict[str, Any]],
) -> Path:
    """Write each of ``files`` (its objects) into ``base`` and the kustomization over them, which
    generates ``config_maps`` and ``secrets`` (none: no secretGenerator); the kustomization's path."""
    for file, objects in files.items():
        write_file(yaml.safe_dump_all(objects, sort_keys=False), base / file)
    kustomization: dict[str, Any] = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": namespace,
        "resources": list(files),
        "configMapGenerator": config_maps,
        "secretGenerator": secrets,
        "generatorOptions": {"disableNameSuffixHash": True, "labels": labels},
    }
    if not secrets:
        del kustomization["secretGenerator"]
    return write_kustomization(base, kustomization)


def write_file(text: str, path: Path) -> None:
    """Write ``path`` (and its folders) through a temporary file and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(text, path)


def write_kustomization(folder: Path, body: dict[str, Any]) -> Path:
    """Write ``folder/kustomization.yaml``; its path."""
    path = folder / "kustomization.yaml"
    write_file(yaml.safe_dump(body, sort_keys=False), path)
    return path


def _server_hosts(name: str, namespace: str, external: str | None) -> list[str]:
    """The names the server's certificate is valid for: its Service's, localhost for ``kubectl port-forward``,
    and the external host's."""
    service = f"{name}-server"
    return [
        service, f"{service}.{namespace}", f"{service}.{namespace}.svc", f"{service}.{namespace}.svc.cluster.local",
        *certs.DEFAULT_HOSTS, *([external] if external else []),
    ]


def _credentials(folder: Path, clients: int, sites: int, hosts: list[str], secrets: dict[str, list[str]]) -> None:
    """``fedweave certs`` into ``folder`` (kept when there already); every file a Secret names must be there,
    and a kept server certificate must be valid for every name of ``hosts``."""
    if not (folder / certs.CA_CERT).exists():
        certs.make_credentials(folder, clients, hosts, sites=sites)
        write_file("# private keys and tokens: never commit them\n*\n", folder / ".gitignore")
    missing = sorted({f for names in secrets.values() for f in names if not (folder / f).is_file()})
    if missing:
        raise ConfigError(
            f"fedweave deploy k8s: {folder} lacks {', '.join(missing)}; remove the folder to create new "
            "credentials, or fill it with `fedweave certs`"
        )
    lacking = [host for host in hosts if host not in _certificate_names(folder / certs.SERVER_CERT)]
    if lacking:
        raise ConfigError(
            f"fedweave deploy k8s: the server certificate in {folder} is not valid for {', '.join(lacking)}; "
            "remove the folder to create new credentials"
        )


def _certificate_names(path: Path) -> set[str]:
    """The DNS names and IP addresses a certificate is valid for."""
    from cryptography import x509

    names = x509.load_pem_x509_certificate(path.read_bytes()).extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    ).value
    return {*names.get_values_for_type(x509.DNSName), *map(str, names.get_values_for_type(x509.IPAddress))}
