"""The nodes of a deployment: ``fedweave server CONFIG`` and ``fedweave client CONFIG --id N``.

Both build their parts from the same config with :mod:`fedweave.build`, so every
process derives the same data partition and the same initial model from the seed.
The server runs :func:`fedweave.loop.run` unchanged over a
:class:`~fedweave.transports.grpc.server.GrpcServerTransport` (FedBuff:
:func:`fedweave.asynchronous.run_deployed`, on the real clock); a client serves its
own id with a :class:`~fedweave.client.ClientRuntime` and keeps its own
:class:`~fedweave.client.ClientStateStore`, so stateful algorithms work across rounds.
In a hierarchical deployment the server's nodes are the site leaders instead
(:mod:`fedweave.topologies.deploy`), one per top-level site of the config's tree.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedweave import rundir, runner
from fedweave.build import build_chains, build_client_runtime, build_task
from fedweave.client import ClientStateStore
from fedweave.config import Config
from fedweave.errors import ConfigError
from fedweave.files import atomic_write_text
from fedweave.topologies.deploy import SiteBatches
from fedweave.topologies.emulated import emulated_handler
from fedweave.topologies.hierarchical import site_tree
from fedweave.topologies.star import Star

log = logging.getLogger(__name__)

PARENT_ENV = "FEDWEAVE_PARENT_PID"
"""Set by the process launcher: a node ends when the process of this id does."""


def server_topology(config: Config, listen: str | None = None) -> Star | SiteBatches:
    """The server's gRPC topology (it starts listening now): a star whose clients connect, or,
    for ``topology.kind: hierarchical``, one node per top-level site whose leader connects."""
    from fedweave.transports.grpc.server import GrpcServerTransport

    if config.topology.kind == "hierarchical":
        tree = site_tree(config.topology.sites, config.clients)  # type: ignore[arg-type]
        return SiteBatches(tree, GrpcServerTransport(config.grpc, len(tree), listen=listen, role="site"))
    return Star(GrpcServerTransport(config.grpc, config.clients, listen=listen))


def serve(
    config: Config,
    run_dir: str | Path,
    *,
    resume: bool = False,
    listen: str | None = None,
    address_file: str | Path | None = None,
    on_record: Callable[[dict[str, Any]], None] | None = None,
) -> runner.Run:
    """Run the server node: listen, build the run in ``run_dir``, serve every round, stop the clients.

    A server restarted with the same arguments carries on (:func:`fedweave.runner.reopen`): it
    resumes after the checkpoint in ``run_dir`` and reruns the interrupted round, whose clients
    register again and drop what they trained in it (the accepted-round mechanism of
    :mod:`fedweave.client`). On a run that already finished it serves no round: it tells the
    clients to stop if its predecessor died before it could, writes the model, and returns.
    ``address_file`` receives the address actually bound (``listen`` may ask for port 0).
    """
    run_dir = Path(run_dir)
    rundir.lock(run_dir)  # before listening: a second server of the run is refused before a client reaches it
    try:
        topology = server_topology(config, listen)
    except BaseException:
        rundir.release(run_dir)
        raise
    try:
        if address_file is not None:
            atomic_write_text(topology.transport.address + "\n", address_file)
        r = runner.resume(run_dir, topology=topology) if resume else runner.reopen(config, run_dir, topology=topology)
        if r.first_round <= r.config.rounds:
            runner.run_rounds(r, on_record)
        else:
            _finished(r, topology)
        return r
    finally:
        topology.close()
        rundir.release(run_dir)


def _finished(r: runner.Run, topology: Star | SiteBatches) -> None:
    """A run that ended before this server started. Without its model, its server died between the
    last checkpoint and telling the clients to stop: wait for them (``grpc.join_timeout``) and tell
    them now, then write the model from the checkpoint."""
    model = runner.result_file(r)
    if not model.is_file():
        transport = topology.transport
        log.info("the run ended without its model: telling the %ss that reconnect to stop", transport.role)
        transport.wait_for_clients(transport.num_nodes, r.config.grpc.join_timeout)
        topology.close()
        runner.save_result(r)
    log.info("the run in %s already finished all %d rounds; its model is %s", r.run_dir, r.config.rounds, model)


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
    task = build_task(config)
    runtime = build_client_runtime(config, task, build_chains(config), ClientStateStore())
    handler = emulated_handler(config, runtime.handle)  # sleeps to an emulated speed (heterogeneity), if any
    client = GrpcClient(config.grpc, client_id, handler, address=address, token=token, seed=config.seed)
    samples = task.clients.train_size(client_id)
    log.info("client %d built (%d training samples); connecting to %s", client_id, samples, client.address)
    done = client.run()
    log.info("client %d answered %d jobs", client_id, done)
    return done


def install_signal_handlers() -> None:
    """SIGTERM ends a node as Ctrl-C does (cleanup runs); with the launcher's parent id set,
    the node also gets SIGTERM when that parent dies, so no node outlives its launcher."""

    def terminate(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)
    parent = os.environ.get(PARENT_ENV)
    if parent and sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            log.debug("cannot ask to be signalled when the launcher dies")
        if str(os.getppid()) != parent:
            raise KeyboardInterrupt  # the launcher is already gone
