"""A two-node Ray cluster on this machine, for the Ray launcher's tests and its benchmark.

``ray start --head`` and then ``ray start --address`` for a second node, both with
``--node-ip-address=127.0.0.1`` (without it the second node looks for the head at the
machine's outside address, where it does not listen) and ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``
unset (0 forbids a second node on Linux). Needs the ``ray`` extra.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import fedweave
from conftest import free_port


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each node's process group (raylet, GCS, workers), then SIGKILL what is left, bounded."""
    for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 10.0)):
        for p in procs:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.2)
    for p in procs:
        p.wait(timeout=5.0)


def _failed(what: str, log: Path) -> RuntimeError:
    """``what`` went wrong, with the end of that node's ``ray start`` output."""
    tail = log.read_text(errors="replace").strip().splitlines()[-5:]
    return RuntimeError(f"{what}; ray start said: " + (" | ".join(tail) or "nothing"))


@contextmanager
def two_node_cluster(cpus: int = 1, timeout: float = 120.0) -> Iterator[str]:
    """The address of a two-node Ray cluster on 127.0.0.1, ``cpus`` CPUs per node, each node in its
    own process group with its own temp folder; its workers import this checkout's fedweave.
    The nodes and this process (the driver) run with ``RAY_AUTH_MODE=disabled`` (a cluster of this
    machine alone, whatever token ``~/.ray`` may hold), this process's setting restored at the end.
    Raises RuntimeError when a node does not start within ``timeout`` seconds; stopped at the end."""
    import ray

    port = free_port()
    address = f"127.0.0.1:{port}"
    src = str(Path(fedweave.__file__).resolve().parents[1])
    env = {
        **os.environ,
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "disabled",
        "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)  # 0 would forbid a second node
    ray_cli = str(Path(sys.executable).with_name("ray"))
    common = ["--block", "--node-ip-address=127.0.0.1", f"--num-cpus={cpus}", "--disable-usage-stats"]
    driver_auth = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    procs: list[subprocess.Popen[bytes]] = []
    temps = [tempfile.mkdtemp(prefix="fwray-") for _ in range(2)]  # short: Ray's socket paths live here
    logs = [Path(t, "start.log") for t in temps]

    def start(args: list[str], i: int) -> None:
        with open(logs[i], "wb") as out:
            procs.append(subprocess.Popen(
                [ray_cli, "start", *args, *common, f"--temp-dir={temps[i]}"],
                env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            ))

    try:
        # the client server's port is free too (its default, 10001, would clash with another suite's cluster)
        start(["--head", f"--port={port}", "--include-dashboard=false", f"--ray-client-server-port={free_port()}"], 0)
        deadline = time.monotonic() + timeout
        while not _listening(port):
            if procs[0].poll() is not None or time.monotonic() > deadline:
                raise _failed("the Ray head did not start", logs[0])
            time.sleep(0.5)
        start([f"--address={address}"], 1)
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
        try:
            while len([n for n in ray.nodes() if n["Alive"]]) < 2:
                if procs[1].poll() is not None or time.monotonic() > deadline:
                    raise _failed("the second Ray node did not join", logs[1])
                time.sleep(0.5)
        finally:
            ray.shutdown()
        yield address
    finally:
        _stop(procs)
        for t in temps:
            shutil.rmtree(t, ignore_errors=True)
        if driver_auth is None:
            del os.environ["RAY_AUTH_MODE"]
        else:
            os.environ["RAY_AUTH_MODE"] = driver_auth
