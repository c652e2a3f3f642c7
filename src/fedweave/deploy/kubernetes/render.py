"""``fedweave deploy k8s``: the deployed config, the credentials and the kustomize folders written."""

from __future__ import annotations

import argparse
import copy
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
    HEALTH_PORT,
    IMAGE,
    Options,
    check_options,
    k8s_name,
    port_of,
)
from fedweave.deploy.kubernetes.manifests import Manifests
from fedweave.errors import ConfigError
from fedweave.files import atomic_write_text
from fedweave.transports.grpc import certs


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


def render(path: str | Path, out: str | Path, options: Options = Options()) -> Rendered:
    """Write the kustomize base and overlays for the config at ``path`` into ``out``."""
    if not Path(path).is_file():
        raise ConfigError(f"fedweave deploy k8s: no config file {str(path)!r}")
    check_options(options)
    data, config, name = deployed_config(path, options)
    k = Manifests(config, name, options)
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
