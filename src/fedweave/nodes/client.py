"""A client node: ``fedweave client CONFIG --id N``, one client of a gRPC deployment.

It serves its own id with a :class:`~fedweave.client.ClientRuntime` and keeps its own
:class:`~fedweave.client.ClientStateStore`, so stateful algorithms work across rounds.
A site says where its data is, which device trains and how many threads (``--data``,
``--device``, or a site file, ``--site FILE``): :func:`site_overrides` turns them into dotted
overrides of this client's own copy of the config, keys that never have to match the server's.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from fedweave.build import TaskBundle, build_chains, build_client_runtime, build_site_task, build_task
from fedweave.client import ClientStateStore
from fedweave.config import Config, read_yaml
from fedweave.errors import ConfigError
from fedweave.topologies.emulated import emulated_handler

log = logging.getLogger(__name__)

SITE_KEYS = {"data": "task.dataset_options.path", "device": "local.device", "threads": "threads"}
"""A site's own settings (a site file's keys, and the flags ``--data``, ``--device``) and the config key
each one sets in that client's config."""


def client_task(config: Config, client_id: int) -> TaskBundle:
    """What client ``client_id`` trains on: where sites bring their own data (``task.dataset: files``)
    its own file alone (``task.dataset_options.path``, which its ``--data`` sets, else its file of the
    path's ``{client}`` template), else its seeded share of the config's dataset."""
    if config.task.dataset != "files":
        return build_task(config)
    options = config.task.file_options()
    return build_site_task(config, client_id, None if options.template else options.path)


def site_overrides(site_file: str | Path | None = None, data: str | None = None, device: str | None = None) -> list[str]:
    """The dotted overrides of a client's site-local keys: those of ``site_file`` (a YAML mapping of
    ``data``, ``device``, ``threads``; a relative ``data`` is in the file's folder), then ``data``
    and ``device`` as given on the command line, which win."""
    values = {} if site_file is None else _site_settings(Path(site_file))
    values.update({key: value for key, value in (("data", data), ("device", device)) if value is not None})
    return [f"{SITE_KEYS[key]}={json.dumps(value)}" for key, value in values.items()]


def _site_settings(path: Path) -> dict[str, Any]:
    """The settings of a site file, its keys checked, its relative data path made the file's folder's."""
    values = read_yaml(path)
    unknown = sorted(set(values) - set(SITE_KEYS))
    if unknown:
        raise ConfigError(
            f"site file {str(path)!r}: key {unknown[0]!r} is not a site's own setting (allowed: {', '.join(SITE_KEYS)})"
        )
    if isinstance(values.get("data"), str) and not Path(values["data"]).is_absolute():
        values["data"] = str(path.parent / values["data"])
    return values


def run_client(config: Config, client_id: int, *, address: str | None = None, token: str | None = None) -> int:
    """Run client node ``client_id`` until the server ends the run; return the jobs it answered."""
    from fedweave.transports.grpc.client import GrpcClient

    if config.transport.kind != "grpc":
        raise ConfigError(
            f"config key 'transport': `fedweave client` connects to a server over gRPC, but this config's "
            f"transport is {config.transport.kind!r} (its clients run inside `fedweave run`); set transport: grpc"
        )
    if not 0 <= client_id < config.clients:
        raise ConfigError(f"--id {client_id} is not a client of this config (clients: 0..{config.clients - 1})")
    task = client_task(config, client_id)
    runtime = build_client_runtime(config, task, build_chains(config), ClientStateStore())
    handler = emulated_handler(config, runtime.handle)  # sleeps to an emulated speed (heterogeneity), if any
    client = GrpcClient(config.grpc, client_id, handler, address=address, token=token, seed=config.seed)
    samples = task.clients.train_size(client_id)
    log.info("client %d built (%d training samples); connecting to %s", client_id, samples, client.address)
    done = client.run()
    log.info("client %d answered %d jobs", client_id, done)
    return done
