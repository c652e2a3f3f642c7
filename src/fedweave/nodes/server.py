"""The server node: ``fedweave server CONFIG``.

It runs :func:`fedweave.federated.rounds.run` unchanged over the gRPC topology of
:func:`fedweave.reach.server_topology` (FedBuff: :func:`fedweave.federated.buffered.run_deployed`,
on the real clock): a star whose clients connect, or, in a hierarchical deployment, one node
per top-level site of the config's tree, whose leader connects (:mod:`fedweave.nodes.site`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedweave import result, rundir, runner
from fedweave.config import Config
from fedweave.files import atomic_write_text
from fedweave.reach import server_topology
from fedweave.topologies.deploy import SiteBatches
from fedweave.topologies.star import Star

if TYPE_CHECKING:
    from fedweave.transports.grpc.server import GrpcServerTransport

log = logging.getLogger(__name__)


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
    :mod:`fedweave.federated.client`). On a run that already finished it serves no round: it tells the
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
            atomic_write_text(listener(topology).address + "\n", address_file)
        r = runner.resume(run_dir, topology=topology) if resume else runner.reopen(config, run_dir, topology=topology)
        if r.first_round <= r.config.rounds:
            runner.run_rounds(r, on_record)
        else:
            _finished(r, topology)
        return r
    finally:
        topology.close()
        rundir.release(run_dir)


def listener(topology: Star | SiteBatches) -> GrpcServerTransport:
    """The gRPC transport :func:`~fedweave.reach.server_topology` gave ``topology``."""
    from fedweave.transports.grpc.server import GrpcServerTransport

    transport = topology.transport
    if not isinstance(transport, GrpcServerTransport):
        raise TypeError(f"a server node listens over gRPC, not {type(transport).__name__}")
    return transport


def _finished(r: runner.Run, topology: Star | SiteBatches) -> None:
    """A run that ended before this server started. Without its model, its server died between the
    last checkpoint and telling the clients to stop: wait for them (``grpc.join_timeout``) and tell
    them now, then write the model from the checkpoint."""
    model = result.result_file(r.run_dir, r.parts.chains.sealer)
    if not model.is_file():
        transport = listener(topology)
        log.info("the run ended without its model: telling the %ss that reconnect to stop", transport.role)
        transport.wait_for_clients(transport.num_nodes, r.config.grpc.join_timeout)
        topology.close()
        runner.save_result(r)
    log.info("the run in %s already finished all %d rounds; its model is %s", r.run_dir, r.config.rounds, model)
