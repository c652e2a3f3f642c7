"""The files of a long-lived federation: the server's ``FED.yaml``, a site's ``SITE.yaml``, an admin's file.

Each is checked when it is loaded, one line naming the key that is wrong; relative paths are the
file's folder's. ``fedweave schema`` does not list these keys: docs/federation-service.md does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedweave.config import parse_address, read_yaml
from fedweave.errors import ConfigError
from fedweave.federation.catalog import Catalog
from fedweave.federation.policy import SitePolicy
from fedweave.federation.ports import parse_ports
from fedweave.schema import opt, parse
from fedweave.transports.grpc.certs import check_name

ADMIN_ENV = "FEDWEAVE_ADMIN"
"""The admin file the job commands read when no ``--admin-file`` is given."""


def _address(value: str, key: str) -> str:
    parse_address(value, f"config key '{key}'")
    return value


def check_job_ports(text: object, max_concurrent_jobs: int, addresses: list[str]) -> range:
    """``job_ports``'s range, checked: none of ``addresses``' ports in it, room for ``max_concurrent_jobs``."""
    ports = parse_ports(text)
    for address in addresses:
        port = int(address.rpartition(":")[2])
        if port in ports:
            raise ConfigError(f"config key 'job_ports': {text} holds port {port} of {address}, the federation's own")
    if len(ports) < max_concurrent_jobs:
        raise ConfigError(f"config key 'job_ports': {text} has {len(ports)} ports, fewer than "
                          f"max_concurrent_jobs={max_concurrent_jobs}")
    return ports


def _names(values: list[str], key: str) -> list[str]:
    for i, name in enumerate(values):
        check_name(name, f"config key '{key}[{i}]'")
    if len(set(values)) != len(values):
        raise ConfigError(f"config key '{key}': a name is listed twice")
    return values


@dataclass
class FederationConfig:
    """``FED.yaml``: the long-lived federation server (``fedweave federation serve``)."""

    address: str = opt(help="host:port of the federation, which sites and admins dial")
    credentials: str = opt(help="folder of `fedweave certs` (ca.pem, server.pem, server.key)")
    store: str = opt(help="the job store: one folder per job, and the server's audit log")
    sites: list[str] = opt(help="the names of the sites that may join (certificates site-<name>)")
    admins: list[str] = opt(help="the names of the admins who may submit and cancel (certificates admin-<name>)")
    listen: str | None = opt(None, help="host:port the federation binds (none: address), e.g. 0.0.0.0:7300")
    health_listen: str | None = opt(
        None, help="host:port of a plaintext port serving only the gRPC health service (for probes)"
    )
    max_concurrent_jobs: int = opt(1, ge=1, le=64, help="jobs running (or being offered) at once")
    offer_timeout: float = opt(
        60.0, gt=0, help="seconds a job waits for every site's answer; a site silent past it takes no part"
    )
    job_host: str | None = opt(
        None, help="the host each job's own server listens on and sites reach (none: address's host)"
    )
    job_ports: str | None = opt(
        None, help="LOW-HIGH: the ports jobs' servers bind, one per running job (none: any free port)"
    )
    site_timeout: float = opt(15.0, gt=0, help="seconds without a poll after which a site counts as away")
    max_bundle_mb: float = opt(64.0, gt=0, le=1024, help="largest code bundle a job may ship, in MiB")

    def validate(self, prefix: str) -> None:
        _address(self.address, "address")
        for key in ("listen", "health_listen"):
            if getattr(self, key) is not None:
                _address(getattr(self, key), key)
        _names(self.sites, "sites")
        _names(self.admins, "admins")
        if not self.sites:
            raise ConfigError("config key 'sites': name at least one site")
        if self.job_host is not None and (not self.job_host or not self.job_host.isprintable() or ":" in self.job_host
                                          and not self.job_host.startswith("[")):
            raise ConfigError(f"config key 'job_host': a host name or IP address, got {self.job_host!r}")
        if self.job_ports is not None:
            check_job_ports(self.job_ports, self.max_concurrent_jobs,
                            [v for v in (self.address, self.listen, self.health_listen) if v is not None])

    @property
    def ports(self) -> range | None:
        """The ports of ``job_ports`` (None: each job's server takes any free port)."""
        return None if self.job_ports is None else parse_ports(self.job_ports)

    @property
    def job_bind_host(self) -> str:
        """The host a job's server binds: with ``job_ports``, ``listen``'s host where set (e.g. 0.0.0.0 in a
        pod whose Service is ``job_host``), else :attr:`host`."""
        if self.job_ports is not None and self.listen is not None:
            return self.listen.rpartition(":")[0]
        return self.host

    @property
    def host(self) -> str:
        """The host every job's server binds and its sites dial."""
        return self.job_host or self.address.rpartition(":")[0]


@dataclass
class SiteConfig:
    """``SITE.yaml``: one site of a federation (``fedweave federation join``)."""

    name: str = opt(help="this site's name, as in its certificate site-<name> and the federation's sites")
    server: str = opt(help="host:port of the federation server")
    credentials: str = opt(help="folder holding ca.pem and this site's site-<name>.pem / .key")
    workdir: str = opt(help="this site's folder: one working folder per job, and the site's audit log")
    catalog: dict[str, Any] = opt(help="the data jobs may name: entry -> {path, format, label, ...}")
    policy: dict[str, Any] | None = opt(None, help="what jobs this site accepts (docs/federation-policy.md)")
    device: str | None = opt(None, help="the device this site's clients train on: auto, cpu, cuda, cuda:N, mps")
    threads: int | None = opt(None, ge=1, help="threads each of this site's clients uses (none: the job's)")
    poll_interval: float = opt(0.5, gt=0, le=60, help="seconds between two polls of the federation")
    backoff_max: float = opt(5.0, gt=0, help="longest wait between two tries to reach an unreachable federation")
    max_client_starts: int = opt(
        5, ge=1, help="times one job's client is started at one job address before the site reports it failed"
    )
    parsed_catalog: Catalog = field(init=False, repr=False)
    parsed_policy: SitePolicy = field(init=False, repr=False)

    def validate(self, prefix: str) -> None:
        check_name(self.name, "config key 'name'")
        _address(self.server, "server")


@dataclass
class AdminConfig:
    """An admin's file (``--admin-file``, ``$FEDWEAVE_ADMIN``): where the federation is and who asks."""

    federation: str = opt(help="host:port of the federation server")
    credentials: str = opt(help="folder holding ca.pem and admin-<name>.pem / .key")
    name: str = opt(help="the admin's name, as in the certificate admin-<name>")

    def validate(self, prefix: str) -> None:
        check_name(self.name, "config key 'name'")
        _address(self.federation, "federation")


def _relative(base: Path, value: str) -> str:
    path = Path(value).expanduser()
    return str(path if path.is_absolute() else (base / path).resolve())


def load_federation(path: str | Path) -> FederationConfig:
    """The federation server's file, checked, its folders made absolute."""
    path = Path(path)
    config: FederationConfig = parse(FederationConfig, read_yaml(path))
    config.credentials = _relative(path.parent, config.credentials)
    config.store = _relative(path.parent, config.store)
    return config


def site_from_dict(data: dict[str, Any], base: Path) -> SiteConfig:
    """A site's config from ``data`` (a SITE.yaml's mapping); relative paths are ``base``'s."""
    config: SiteConfig = parse(SiteConfig, data)
    config.credentials = _relative(base, config.credentials)
    config.workdir = _relative(base, config.workdir)
    config.parsed_catalog = Catalog.from_dict(config.catalog, key="catalog", base=base)
    config.parsed_policy = SitePolicy.from_dict(config.policy, key="policy")
    config.parsed_policy.check_entries(config.parsed_catalog.names(), key="policy")
    return config


def load_site(path: str | Path) -> SiteConfig:
    """A site's file, checked (its catalogue's paths must exist, its policy's entries be the catalogue's)."""
    path = Path(path)
    return site_from_dict(read_yaml(path), path.parent)


def load_admin(path: str | Path) -> AdminConfig:
    """An admin's file, checked, its credentials folder made absolute."""
    path = Path(path)
    config: AdminConfig = parse(AdminConfig, read_yaml(path))
    config.credentials = _relative(path.parent, config.credentials)
    return config
