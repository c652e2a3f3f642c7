"""A client node: ``fedweave client CONFIG --id N``, one client of a gRPC deployment.

It serves its own id with a :class:`~fedweave.client.ClientRuntime` and keeps its own
:class:`~fedweave.client.ClientStateStore`, so stateful algorithms work across rounds.
"""

from __future__ import annotations

import logging

from fedweave.build import build_chains, build_client_runtime, build_site_task, build_task, sites_read_own_data
from fedweave.client import ClientStateStore
from fedweave.config import Config
from fedweave.errors import ConfigError
from fedweave.topologies.emulated import emulated_handler

log = logging.getLogger(__name__)


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
    client = GrpcClient(
        config.grpc, client_id, handler, address=address, token=token, seed=config.seed, declaration=declaration
    )
    samples = task.clients.train_size(client_id)
    log.info("client %d built (%d training samples); connecting to %s", client_id, samples, client.address)
    done = client.run()
    log.info("client %d answered %d jobs", client_id, done)
    return done
