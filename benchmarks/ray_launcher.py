"""The Ray launcher against the in-process launcher on the same run.

Starts a two-node Ray cluster on this machine (the tests' ``tests/ray_cluster.py``: ``ray
start --head``, then ``ray start --address`` for a second node, each with its own temp folder
and ``--cpus`` CPUs), runs the same federated run (digits, FedAvg) in process and with
``launcher: ray`` (one actor per CPU of the cluster), and prints for each the start-up cost
(``runner.prepare``: task, model, and for Ray joining the cluster and starting the actors,
which build the task each) and the mean seconds per round, with the ratios Ray / in-process.
It checks that both runs reach the same metrics. The cluster's own start is printed apart
and stopped at the end.

    python benchmarks/ray_launcher.py [--clients 8] [--rounds 5] [--epochs 1] [--cpus 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from fedweave import config as config_mod
from fedweave import runner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the Ray launcher tests' cluster

from ray_cluster import two_node_cluster  # noqa: E402


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
