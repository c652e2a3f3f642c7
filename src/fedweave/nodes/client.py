"""A client node: ``fedweave client CONFIG --id N``, one client of a gRPC deployment.

It serves its own id with a :class:`~fedweave.federated.client.ClientRuntime` and keeps its own
:class:`~fedweave.federated.client.ClientStateStore`, so stateful algorithms work across rounds.
A site says where its data is, which device trains and how many threads (``--data``,
``--device``, or a site file, ``--site FILE``): :func:`site_overrides` turns them into dotted
overrides of this client's own copy of the config, keys that never have to match the server's.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from fedweave.build import build_chains, build_client_runtime, build_site_task, build_task, sites_read_own_data
from fedweave.federated.client import ClientStateStore
from fedweave.config import Config, read_yaml
from fedweave.errors import ConfigError
from fedweave.liveness import heartbeat
from fedweave.topologies.emulated import emulated_handler

log = logging.getLogger(__name__)

SITE_KEYS = {"data": None, "device": "local.device", "threads": "threads"}
"""A site's own settings (a site file's keys, and the flags ``--data``, ``--device``) and the config key
each one sets in that client's config; ``data`` sets none: the client reads that file alone
(:func:`site_data`, :func:`run_client`'s ``data``)."""


def site_overrides(site_file: str | Path | None = None, device: str | None = None) -> list[str]:
    """The dotted overrides of a client's site-local keys: those of ``site_file`` (a YAML mapping of
    ``data``, ``device``, ``threads``), then ``device`` as given on the command line, which wins."""
    values = {} if site_file is None else _site_settings(Path(site_file))
    if device is not None:
        values["device"] = device
    return [f"{SITE_KEYS[key]}={json.dumps(value)}" for key, value in values.items() if SITE_KEYS[key] is not None]


def site_data(site_file: str | Path | None = None, data: str | None = None) -> str | None:
    """The one data file or folder a client reads: ``data`` (``--data``), else its site file's ``data``
    (a relative path in the file's folder); None: the config's own (a ``{client}`` path)."""
    if data is not None or site_file is None:
        return data
    return _site_settings(Path(site_file)).get("data")


def _site_settings(path: Path) -> dict[str, Any]:
    """The settings of a site file, its keys checked, its relative data path made the file's folder's."""
    values = read_yaml(path)
    if not isinstance(values, dict):
        raise ConfigError(f"site file {str(path)!r}: a mapping of {', '.join(SITE_KEYS)} expected")
    unknown = sorted(set(values) - set(SITE_KEYS))
    if unknown:
        raise ConfigError(
            f"site file {str(path)!r}: key {unknown[0]!r} is not a site's own setting (allowed: {', '.join(SITE_KEYS)})"
        )
    if isinstance(values.get("data"), str) and not Path(values["data"]).is_absolute():
        values["data"] = str(path.parent / values["data"])
    return values


def run_client(
    config: Config, client_id: int, *, address: str | None = None, token: str | None = None, data: str | None = None
) -> int:
    """Run client node ``client_id`` until the server ends the run; return the jobs it answered. With
    ``data`` (``--data``), or a ``{client}`` path, it reads only its own file and declares its schema."""
    from fedweave.transports.grpc.client import GrpcClient

    if config.transport.kind != "grpc":
        raise ConfigError(
            f"config key 'transport': `fedweave client` connects to a server over gRPC, but this config's "
            f"transport is {config.transport.kind!r} (its clients run inside `fedweave run`); set transport: grpc"
        )
    if not 0 <= client_id < config.clients:
        raise ConfigError(f"--id {client_id} is not a client of this config (clients: 0..{config.clients - 1})")
    own = data is not None or sites_read_own_data(config)
    task = build_site_task(config, client_id, data) if own else build_task(config)
    runtime = build_client_runtime(config, task, build_chains(config), ClientStateStore())
    handler = emulated_handler(config, runtime.handle)  # sleeps to an emulated speed (heterogeneity), if any
    declaration = task.schema.to_dict() if own and task.schema is not None else None
    samples = task.clients.train_size(client_id)
    client = GrpcClient(
        config.grpc, client_id, handler, address=address, token=token, seed=config.seed, declaration=declaration,
        examples=samples if own else None,  # a site that reads its own data knows its size: its claims' ceiling
    )
    log.info("client %d built (%d training samples); connecting to %s", client_id, samples, client.address)
    with heartbeat(config.grpc.heartbeat_interval):  # FEDWEAVE_HEARTBEAT's file, while it serves
        done = client.run()
    log.info("client %d answered %d jobs", client_id, done)
    return done
