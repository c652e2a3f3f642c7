"""The process launcher: the server and every client as local processes over gRPC.

``fedweave run CONFIG launcher=process`` (or :func:`fedweave.runner.execute` of such a
run) starts ``fedweave server`` on 127.0.0.1 with a port the system picks, and with it
``fedweave client --id i`` for every client (they retry until the server listens), or per site a
leader and its members (``fedweave site``): the entry points of :mod:`fedweave.nodes`. Each
node's output is forwarded through :mod:`logging` line by line with a node prefix
(``[server]``, ``[client 3]``). The launcher follows the run's ``metrics.jsonl`` to
report each round as it ends, and loads the final model when the server is done
(:func:`fedweave.result.load_result`: decrypted, where the server kept it encrypted).

Every wait is bounded. When the server ends, clients get a bounded grace period to
leave on their own; then they are terminated, then killed. On Ctrl-C or any error all
nodes are stopped the same way, and each node also dies with its launcher (Linux,
:mod:`fedweave.nodes.signals`), so no process is left behind.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from fedweave.errors import FedweaveError
from fedweave.nodes.signals import PARENT_ENV
from fedweave.result import load_result
from fedweave.rundir import CONFIG_FILE, METRICS_FILE, MetricsTail
from fedweave.topologies.deploy import site_members
from fedweave.topologies.hierarchical import site_tree
from fedweave.transports.grpc.protocol import AUTO, CREDENTIALS_ENV

if TYPE_CHECKING:
    from fedweave.runner import Run

log = logging.getLogger(__name__)

POLL = 0.1
STOP_GRACE = 5.0  # seconds between SIGTERM and SIGKILL

_LEVELS = {name: getattr(logging, name) for name in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")}


class Node:
    """One started process and the thread that forwards its output."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str]):
        self.name = name
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # Ctrl-C reaches the launcher, which stops the nodes in order
        )
        self.lines: list[str] = []  # the last lines, for error messages
        self.reader = threading.Thread(target=self._forward, args=(self.proc.stdout,), daemon=True)
        self.reader.start()

    def _forward(self, stream: IO[bytes]) -> None:
        level = logging.WARNING
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip()
            if not line:
                continue
            first = line.split(" ", 1)[0]
            level = _LEVELS.get(first, level)  # continuation lines keep the last level
            self.lines = [*self.lines[-19:], line]
            log.log(level, "[%s] %s", self.name, line)
        stream.close()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def terminate(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()


class Nodes:
    """The started nodes; :meth:`stop` ends them all within bounded time."""

    def __init__(self, level: int):
        self.items: list[Node] = []
        self.env = {**os.environ, PARENT_ENV: str(os.getpid()), "PYTHONUNBUFFERED": "1"}
        self.level = logging.getLevelName(level)

    def start(self, name: str, args: list[str]) -> Node:
        argv = [sys.executable, "-m", "fedweave", *args, "--log-level", self.level]
        node = Node(name, argv, self.env)
        self.items.append(node)
        log.info("started %s (pid %d)", name, node.proc.pid)
        return node

    def wait(self, nodes: list[Node], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while any(n.alive() for n in nodes) and time.monotonic() < deadline:
            time.sleep(POLL)
        return not any(n.alive() for n in nodes)

    def stop(self, grace: float) -> None:
        """Wait up to ``grace`` s for nodes to leave, then SIGTERM, then SIGKILL."""
        if not self.wait(self.items, grace):
            for n in self.items:
                n.terminate()
            if not self.wait(self.items, STOP_GRACE):
                for n in self.items:
                    if n.alive():
                        log.warning("%s did not stop; killing it", n.name)
                        n.kill()
                self.wait(self.items, STOP_GRACE)
        for n in self.items:
            n.reader.join(timeout=1.0)


def launch_processes(r: Run, on_record: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Run ``r`` with its server and clients as local processes; return all its records."""
    cfg = r.config
    run_dir = Path(r.run_dir).resolve()
    config_file = str(run_dir / CONFIG_FILE)
    nodes = Nodes(logging.getLogger("fedweave").getEffectiveLevel())
    tail = MetricsTail(run_dir / METRICS_FILE, skip=len(r.records))
    started = time.monotonic()
    clean = False
    try:
        server_args = ["server"]
        if r.first_round > 1:
            server_args += ["--resume", str(run_dir)]
        else:
            server_args += [config_file, "--run-dir", str(run_dir)]
        address = f"127.0.0.1:{_free_port()}"
        if cfg.grpc.credentials == AUTO:  # every node runs here: fresh credentials for this run
            nodes.env[CREDENTIALS_ENV] = str(_credentials(cfg, run_dir))
        server = nodes.start("server", [*server_args, "--listen", address])
        if cfg.topology.kind == "hierarchical" and cfg.topology.inner == "torchdist":
            _start_sites(nodes, cfg, config_file, address)
        else:
            for cid in range(cfg.clients):  # clients retry until the server listens
                nodes.start(f"client {cid}", ["client", config_file, "--id", str(cid), "--address", address])
        while server.alive():
            _report(tail, r, on_record)
            time.sleep(POLL)
        _report(tail, r, on_record)
        code = server.proc.wait()
        if code != 0:
            detail = "; ".join(server.lines[-3:]) or "no output"
            raise FedweaveError(f"the server process exited with code {code}: {detail}")
        clean = True
    finally:
        s = cfg.grpc
        nodes.stop(grace=s.poll_timeout + s.heartbeat_interval + 2.0 if clean else 0.0)
    log.info("all %d nodes stopped after %.1f s", len(nodes.items), time.monotonic() - started)
    r.params = load_result(run_dir, r.parts.chains.sealer)
    return r.records


def _start_sites(nodes: Nodes, cfg: Any, config_file: str, address: str) -> None:
    """Per top-level site: its leader (one gRPC node of the server for the whole site) and
    its members, in the site's own torch.distributed world on a port picked here."""
    for site in range(len(site_tree(cfg.topology.sites, cfg.clients))):
        port = str(_free_port())
        for rank in range(1 + len(site_members(cfg, site))):
            name = f"site {site} leader" if rank == 0 else f"site {site} rank {rank}"
            nodes.start(name, ["site", config_file, "--site", str(site), "--rank", str(rank), "--address", address, "--port", port])


def _credentials(cfg: Any, run_dir: Path) -> Path:
    """A CA, server, client (and site leader) certificates and tokens in the run directory."""
    from fedweave.transports.grpc.certs import make_credentials

    sites = len(site_tree(cfg.topology.sites, cfg.clients)) if cfg.topology.kind == "hierarchical" else 0
    return make_credentials(run_dir / "credentials", cfg.clients, sites=sites)


def _free_port() -> int:
    """A port free on 127.0.0.1 now (the server binds it moments later, SO_REUSEPORT off)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _report(tail: MetricsTail, r: Run, on_record: Callable[[dict[str, Any]], None] | None) -> None:
    for record in tail.read():
        r.records.append(record)
        if on_record is not None:
            on_record(record)
