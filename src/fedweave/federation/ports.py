"""The ports of ``FED.yaml``'s ``job_ports``: each running job's own server takes a free one.

A federation whose sites reach its jobs only through fixed ports (a Kubernetes Service, a firewall)
names a range ``LOW-HIGH``; the service binds each job's server to the first port of it that no
running job holds and nothing else on the host is bound to.
"""

from __future__ import annotations

import socket
from collections.abc import Collection

from fedweave.errors import ConfigError


def parse_ports(text: object, what: str = "config key 'job_ports'") -> range:
    """The ports ``LOW-HIGH`` names (both included), or a one-line error naming ``what``."""
    low, sep, high = text.partition("-") if isinstance(text, str) else ("", "", "")
    if not sep or not (low + high).isascii() or not low.isdigit() or not high.isdigit():
        raise ConfigError(f"{what}: expected LOW-HIGH, a range of ports such as 7400-7409, got {text!r}")
    first, last = int(low), int(high)
    if not 1 <= first <= 65535 or not 1 <= last <= 65535:
        raise ConfigError(f"{what}: ports lie in 1-65535, got {text!r}")
    if first > last:
        raise ConfigError(f"{what}: LOW is at most HIGH, got {text!r}")
    return range(first, last + 1)


def _bindable(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free to a server
        try:
            sock.bind((host.strip("[]"), port))
        except OSError:  # in use, privileged, or not an address of this host
            return False
    return True


def free_port(ports: range, host: str, taken: Collection[int]) -> int | None:
    """The first port of ``ports`` not in ``taken`` that ``host`` can bind now (None: none is free)."""
    for port in ports:
        if port not in taken and _bindable(host, port):
            return port
    return None
