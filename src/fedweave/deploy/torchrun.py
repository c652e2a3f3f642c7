"""How a host's torchrun agent joins a multi-host data-parallel job: ``fedweave worker CONFIG
--nnodes N --rdzv-endpoint HOST:PORT`` on every host.

torchrun on its own takes a host's address from its hostname: where that resolves to 127.0.0.1
(a laptop, a container, many a machine off DNS), the agent advertises an address no other host
reaches, gloo binds loopback, and no agent may think it hosts the rendezvous store; the job waits
for a rendezvous that never completes. :func:`agent_command` asks the routing table instead:
the address of the interface that reaches the endpoint (:func:`route`) becomes the agent's
``--local-addr``, that interface gloo's (``GLOO_SOCKET_IFNAME``), and the host whose address the
endpoint names hosts the store (``is_host``). Nothing here imports torch: the agent's command
starts fast and replaces the process.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import socket
import struct
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fedweave.errors import FedweaveError

log = logging.getLogger(__name__)

SIOCGIFADDR = 0x8915  # Linux: the IPv4 address of an interface


class AgentError(FedweaveError):
    """The rendezvous endpoint cannot be parsed, resolved or reached."""


def route(host: str, port: int) -> tuple[str, str]:
    """The address of this machine's interface that reaches ``host`` (a UDP socket's connect picks
    the route; no packet is sent), and ``host``'s address."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
        family, _, _, _, address = min(infos, key=lambda info: info[0] != socket.AF_INET)  # IPv4 first
    except socket.gaierror as exc:
        raise AgentError(f"--rdzv-endpoint {host}:{port}: cannot resolve {host!r}: {exc.strerror}") from None
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(address[:2])
        except OSError as exc:
            raise AgentError(f"--rdzv-endpoint {host}:{port}: no route to it: {exc.strerror}") from None
        return str(probe.getsockname()[0]), str(address[0])


def interface_of(address: str) -> str | None:
    """The name of the network interface that holds the IPv4 ``address`` (None: none, or IPv6)."""
    if ipaddress.ip_address(address).version != 4:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address
                continue
            if socket.inet_ntoa(answer[20:24]) == address:
                return name
    return None


@dataclass(frozen=True)
class Agent:
    """How this host's torchrun agent joins a job whose rendezvous is at ``endpoint``."""

    endpoint: str
    nnodes: str = "1"
    nproc_per_node: str = "1"
    rdzv_id: str = "fedweave"
    max_restarts: int = 0
    rdzv_conf: str = ""


def agent_command(agent: Agent, worker_args: Sequence[str],
                  environ: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """The torchrun agent's command (``python -m torch.distributed.run``, workers running
    ``fedweave.data_parallel`` with ``worker_args``) and environment: this host's address is the
    interface's that reaches the endpoint, gloo uses that interface (``GLOO_SOCKET_IFNAME``, unless
    set), and the host the endpoint names (not a loopback endpoint, which torchrun handles) hosts the
    rendezvous store."""
    host, colon, port = agent.endpoint.rpartition(":")
    if not colon or not host or not port.isdigit():
        raise AgentError(f"--rdzv-endpoint {agent.endpoint!r} is not HOST:PORT")
    local, endpoint = route(host.strip("[]"), int(port))
    conf = [c for c in agent.rdzv_conf.split(",") if c]
    if not ipaddress.ip_address(endpoint).is_loopback and not any(c.startswith("is_host=") for c in conf):
        conf.append(f"is_host={str(endpoint == local).lower()}")
    env = {**environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")}
    interface = interface_of(local)
    if interface is not None and "GLOO_SOCKET_IFNAME" not in environ:
        env["GLOO_SOCKET_IFNAME"] = interface
    command = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={agent.nnodes}", f"--nproc-per-node={agent.nproc_per_node}", "--rdzv-backend=c10d",
        f"--rdzv-endpoint={agent.endpoint}", f"--rdzv-id={agent.rdzv_id}", f"--max-restarts={agent.max_restarts}",
        f"--local-addr={local}", *([f"--rdzv-conf={','.join(conf)}"] if conf else []),
        "-m", "fedweave.data_parallel", *worker_args,
    ]
    log.info("torchrun agent at %s (interface %s), rendezvous at %s", local, interface, agent.endpoint)
    return command, env
