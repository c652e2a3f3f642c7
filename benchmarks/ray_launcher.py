"""The Ray launcher against the in-process launcher on the same run.

Starts a two-node Ray cluster on this machine (``ray start --head``, then ``ray start
--address`` for a second node, each with its own temp folder and ``--cpus`` CPUs), runs
the same federated run (digits, FedAvg) in process and with ``launcher: ray`` (one actor
per CPU of the cluster), and prints for each the start-up cost (``runner.prepare``: task,
model, and for Ray joining the cluster and starting the actors, which build the task each)
and the mean seconds per round, with the ratios Ray / in-process. It checks that both runs
reach the same metrics. The cluster's own start is printed apart and stopped at the end.

    python benchmarks/ray_launcher.py [--clients 8] [--rounds 5] [--epochs 1] [--cpus 1]
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import fedweave
from fedweave import config as config_mod
from fedweave import runner


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@contextmanager
def two_node_cluster(cpus: int, timeout: float = 120.0) -> Iterator[str]:
    """A head and a second node on 127.0.0.1, each its own process group; killed at the end."""
    import ray

    port = _free_port()
    address = f"127.0.0.1:{port}"
    os.environ["RAY_AUTH_MODE"] = "disabled"  # a cluster of this machine alone, the driver included
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(fedweave.__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)  # 0 would forbid the second node
    common = ["--block", "--node-ip-address=127.0.0.1", f"--num-cpus={cpus}", "--disable-usage-stats"]
    procs, temps = [], []
    deadline = time.monotonic() + timeout
    try:
        for args in (["--head", f"--port={port}", "--include-dashboard=false"], [f"--address={address}"]):
            temp = tempfile.mkdtemp(prefix="fwray-")
            temps.append(temp)
            procs.append(subprocess.Popen(
                [str(Path(sys.executable).with_name("ray")), "start", *args, *common, f"--temp-dir={temp}"],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            ))
            if len(procs) == 1:
                while not _listening(port):
                    if time.monotonic() > deadline or procs[0].poll() is not None:
                        raise RuntimeError("the Ray head did not start")
                    time.sleep(0.5)
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
        try:
            while len([n for n in ray.nodes() if n["Alive"]]) < 2:
                if time.monotonic() > deadline:
                    raise RuntimeError("the second Ray node did not join")
                time.sleep(0.5)
        finally:
            ray.shutdown()
        yield address
    finally:
        for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 10.0)):
            for p in procs:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
            end = time.monotonic() + grace
            while time.monotonic() < end and any(p.poll() is None for p in procs):
                time.sleep(0.2)
        for temp in temps:
            shutil.rmtree(temp, ignore_errors=True)


def measure(overrides: list[str], out: Path) -> tuple[float, float, dict]:
    """(start-up seconds, mean seconds per round, last record) of one run."""
    start = time.perf_counter()
    r = runner.prepare(config_mod.load(None, overrides), out)
    startup = time.perf_counter() - start
    records = runner.execute(r)
    return startup, statistics.mean(rec["wall_time"] for rec in records), records[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--cpus", type=int, default=1, help="CPUs of each of the two Ray nodes")
    args = ap.parse_args()
    run = [
        f"clients={args.clients}",
        f"rounds={args.rounds}",
        f"local.epochs={args.epochs}",
        "task.dataset=digits",
        "eval.federated_every=0",
        "checkpoint.every=0",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        local = measure(run, Path(tmp, "local"))
        started = time.perf_counter()
        with two_node_cluster(args.cpus) as address:
            cluster_start = time.perf_counter() - started
            remote = measure([*run, "launcher=ray", f"ray.address={address}"], Path(tmp, "ray"))
    for key in ("test_accuracy", "test_loss"):
        if abs(local[2][key] - remote[2][key]) > 1e-6:
            raise SystemExit(f"the runs differ: {key} {local[2][key]} in process, {remote[2][key]} on Ray")
    print(f"run: digits, {args.clients} clients, {args.rounds} rounds, {args.epochs} local epoch(s); "
          f"Ray: 2 nodes x {args.cpus} CPU(s), one actor per CPU (cluster start {cluster_start:.1f} s, not counted)")
    print(f"{'':12}{'start-up s':>12}{'s / round':>12}")
    print(f"{'in process':12}{local[0]:12.3f}{local[1]:12.3f}")
    print(f"{'Ray':12}{remote[0]:12.3f}{remote[1]:12.3f}")
    print(f"{'Ray / local':12}{remote[0] / local[0]:12.2f}{remote[1] / local[1]:12.2f}")
    print(f"same metrics: test_accuracy {remote[2]['test_accuracy']:.4f} in both")


if __name__ == "__main__":
    main()
