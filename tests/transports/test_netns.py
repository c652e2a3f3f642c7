"""gRPC over a slow link: a server and a client in two network namespaces joined by a veth pair
whose both ends a token bucket (``tc qdisc ... tbf``) limits to 20 Mbit/s.

- a model transfer runs at about the link's rate (a loopback would be ~100x faster);
- a round whose transfer cannot finish before its deadline fails at the deadline, and the
  server stops spending the link on it;
- a link taken down mid-transfer loses the client within ``heartbeat_timeout``;
- nothing hangs: every wait here is bounded, and the namespaces are always removed.

Needs root, ``ip netns`` and the tbf qdisc (``netem`` is not needed); skipped with the reason
otherwise.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

import pytest

RATE_MBIT = 20
SERVER_IP, CLIENT_IP = "10.77.0.1", "10.77.0.2"
ADDRESS = f"{SERVER_IP}:50051"  # in a namespace of its own, so the port is free
GRPC = [
    "clients=1",
    "transport=grpc",
    "grpc.heartbeat_interval=0.2",
    "grpc.heartbeat_timeout=2.5",
    "grpc.poll_timeout=0.5",
    "grpc.rpc_timeout=2",
    "grpc.connect_timeout=20",
    "grpc.join_timeout=30",
    "grpc.backoff_initial=0.05",
    "grpc.backoff_max=0.5",
]

SERVER = textwrap.dedent(
    """
    import json, sys, time
    import torch
    from fedweave import config
    from fedweave.transports.grpc.server import GrpcServerTransport
    from fedweave.types import Instruction, Message, TaskKind, Work

    torch.set_num_threads(1)
    settings = config.load(None, json.loads(sys.argv[1])).grpc
    server = GrpcServerTransport(settings, 1, listen=sys.argv[2])
    for line in sys.stdin:  # one command per line: a round to run, or stop
        cmd = json.loads(line)
        if cmd.get("stop"):
            break
        rnd = cmd["round"]
        params = {"w": torch.ones(cmd["floats"])}
        print(json.dumps({"started": rnd}), flush=True)
        began = time.monotonic()
        ex = server.exchange([Message(rnd, 0, Instruction(rnd, TaskKind.TRAIN, Work(0, 8), params))], cmd["timeout"])
        print(json.dumps({
            "round": rnd, "elapsed": time.monotonic() - began, "sent": ex.bytes_sent,
            "received": ex.bytes_received, "replies": len(ex.replies), "failures": ex.failures,
        }), flush=True)
    began = time.monotonic()
    server.close()
    print(json.dumps({"closed": time.monotonic() - began}), flush=True)
    """
)

CLIENT = textwrap.dedent(
    """
    import json, sys
    import torch
    from fedweave import config
    from fedweave.transports.grpc.client import GrpcClient
    from fedweave.types import Message, Update, UpdateKind

    torch.set_num_threads(1)
    settings = config.load(None, json.loads(sys.argv[1])).grpc

    def echo(msg):
        return Message(msg.round, 0, Update(UpdateKind.WEIGHTS, msg.body.params, 10, client_id=0))

    GrpcClient(settings, 0, echo, address=sys.argv[2]).run()
    """
)


def run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=10)


@dataclass
class Link:
    """Two namespaces, ``server`` and ``client``, joined by veth ends ``server_dev`` / ``client_dev``."""

    server: str
    client: str
    server_dev: str
    client_dev: str

    def set(self, up: bool) -> None:
        done = run("ip", "-n", self.client, "link", "set", self.client_dev, "up" if up else "down")
        assert done.returncode == 0, done.stderr


def _setup(link: Link) -> str | None:
    """Build the link; the reason it cannot be built here, or None."""
    steps = [
        ("ip", "netns", "add", link.server),
        ("ip", "netns", "add", link.client),
        ("ip", "link", "add", link.server_dev, "type", "veth", "peer", "name", link.client_dev),
        ("ip", "link", "set", link.server_dev, "netns", link.server),
        ("ip", "link", "set", link.client_dev, "netns", link.client),
    ]
    for ns, dev, ip in ((link.server, link.server_dev, SERVER_IP), (link.client, link.client_dev, CLIENT_IP)):
        steps += [
            ("ip", "-n", ns, "addr", "add", f"{ip}/30", "dev", dev),
            ("ip", "-n", ns, "link", "set", dev, "up"),
            ("ip", "-n", ns, "link", "set", "lo", "up"),
        ]
    for step in steps:
        done = run(*step)
        if done.returncode != 0:
            return f"`{' '.join(step)}` is not permitted here: {done.stderr.strip()}"
    for ns, dev in ((link.server, link.server_dev), (link.client, link.client_dev)):
        tbf = ("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf")
        done = run(*tbf, "rate", f"{RATE_MBIT}mbit", "burst", "32kbit", "latency", "400ms")
        if done.returncode != 0:
            return f"the tbf qdisc is not available: {done.stderr.strip()}"
    return None


@pytest.fixture
def link() -> Iterator[Link]:
    if os.geteuid() != 0:
        pytest.skip("this test puts the gRPC server and client in two network namespaces, which need root")
    if shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("the ip and tc commands (iproute2) that build the rate-limited link are not installed")
    tag = f"fw{os.getpid() % 100000}"
    made = Link(f"{tag}-srv", f"{tag}-cli", f"{tag}s", f"{tag}c")
    try:
        why = _setup(made)
        if why is not None:
            pytest.skip(why)
        yield made
    finally:
        for ns in (made.server, made.client):  # removing a namespace removes its veth end
            run("ip", "netns", "del", ns)
        run("ip", "link", "del", made.server_dev)  # left in the root namespace if setup broke off early


class Node:
    """A process in a namespace; its stdout lines as JSON, read with a bound."""

    def __init__(self, ns: str, script: str, *args: str):
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-c", script, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            if line.startswith("{"):
                self.lines.put(json.loads(line))

    def next(self, timeout: float) -> dict[str, Any]:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no answer from the node within {timeout} s") from None

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


def test_grpc_over_a_rate_limited_link(link: Link) -> None:
    overrides = json.dumps(GRPC)
    server = Node(link.server, SERVER, overrides, ADDRESS)
    client = Node(link.client, CLIENT, overrides, ADDRESS)  # it retries until the server listens
    try:

        def round_(rnd: int, floats: int, timeout: float) -> dict[str, Any]:
            server.send(round=rnd, floats=floats, timeout=timeout)
            assert server.next(timeout=60) == {"started": rnd}
            return server.next(timeout=timeout + 30)

        assert round_(1, 1000, 60)["failures"] == {}  # the client has joined
        # (a) 2.5 MB down and 2.5 MB back: about the link's rate
        done = round_(2, 625_000, 30)
        assert done["failures"] == {} and done["sent"] >= 2_500_000 and done["received"] >= 2_500_000
        rate = (done["sent"] + done["received"]) * 8 / done["elapsed"] / 1e6
        # never above the link's rate; below it only as far as a loaded host may slow the ends
        assert 0.2 * RATE_MBIT < rate < 1.1 * RATE_MBIT, f"{rate:.1f} Mbit/s on a {RATE_MBIT} Mbit/s link"
        # (b) 20 MB cannot cross in 1 s (8 s of link): the round fails at its deadline, and sending
        # stops; bounds far from the 8 s a transfer that went on would take, whatever the load
        done = round_(3, 5_000_000, 1.0)
        assert done["failures"] == {"0": "missed the round deadline (1 s)"}
        assert 1.0 <= done["elapsed"] < 5
        done = round_(4, 1000, 30)  # at once: the rest of round 3's 20 MB (7 s of link) was not sent
        assert done["failures"] == {} and done["elapsed"] < 5
        # (b) the link goes down mid-transfer: the client is lost after heartbeat_timeout, not the 30 s deadline
        server.send(round=5, floats=2_500_000, timeout=30)
        assert server.next(timeout=60) == {"started": 5}
        time.sleep(0.5)
        link.set(up=False)
        done = server.next(timeout=30)
        assert done["replies"] == 0 and done["failures"]["0"].startswith("lost: it has not sent a heartbeat")
        assert done["elapsed"] < 15  # heartbeat_timeout (2.5 s) and slack, half the deadline
        server.send(stop=True)
        assert server.next(timeout=30)["closed"] < 15  # nobody left to wait for
        assert server.proc.wait(timeout=30) == 0
    finally:
        server.kill()
        client.kill()
