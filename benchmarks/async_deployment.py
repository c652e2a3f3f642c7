"""FedBuff deployed over gRPC against synchronous FedAvg, 10 client processes at speeds 1-8x.

Workload: scikit-learn's digits (1,437 training / 360 test images), an MLP, 10 clients
with an IID split, 1 local epoch of batch 16 at lr 0.05. Both runs use ``launcher: process``:
the server and 10 ``fedweave client`` processes on this machine, over gRPC on 127.0.0.1.
Each client emulates an unlike machine on the real clock (``heterogeneity.speeds``, 1 to 8
evenly spaced, ``heterogeneity.slowdown``): it sleeps so that its training lasts
``slowdown x 8 / speed`` times its CPU time, so the slowest client is 8 times slower than
the fastest.

- ``fedavg``: synchronous rounds, every client every round (each round waits for the slowest);
- ``fedbuff``: ``asynchronous.enabled``, all 10 clients training at once, a server step every
  ``--buffer`` arrivals, staleness weight 1/sqrt(1 + t).

Printed per run: the real seconds from the first job to the first evaluation at or above the
target accuracy (FedAvg: its rounds' wall times summed; FedBuff: the record's ``clock``), the
steps it took, the final accuracy, and for FedBuff the distribution of the staleness of the
applied updates; then the wall-time ratio FedAvg / FedBuff. Process start-up (10 interpreters
importing torch) is not in either time.

    python benchmarks/async_deployment.py [--target 0.9] [--slowdown 20] [--buffer 3] [--rounds 25] [--steps 120]
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from fedweave import config as config_mod
from fedweave import runner

CLIENTS = 10


def overrides(args: argparse.Namespace) -> list[str]:
    speeds = [round(1 + 7 * i / (CLIENTS - 1), 3) for i in range(CLIENTS)]
    return [
        "name=async-deployment-bench",
        f"clients={CLIENTS}",
        "task.dataset=digits",
        "task.model=mlp",
        "task.partition.scheme=iid",
        "local.epochs=1",
        "local.batch_size=16",
        "local.lr=0.05",
        "transport=grpc",
        "launcher=process",
        "grpc.allow_unauthenticated=true",
        f"heterogeneity.speeds={speeds}",
        f"heterogeneity.slowdown={args.slowdown}",
        "eval.every=1",
        "eval.federated_every=0",
        "checkpoint.every=0",
        "threads=1",
    ]


def run(name: str, extra: list[str], args: argparse.Namespace, out: Path) -> dict[str, Any]:
    config = config_mod.load(None, [*overrides(args), *extra, f"output_dir={out}"])
    began = time.perf_counter()
    records = runner.execute(runner.prepare(config, out / name))
    total = time.perf_counter() - began
    elapsed, reached = 0.0, None
    for record in records:
        elapsed = record["clock"] if "clock" in record else elapsed + record["wall_time"]
        if reached is None and (record.get("test_accuracy") or 0.0) >= args.target:
            reached = (elapsed, record["round"])
    staleness = Counter(c["staleness"] for r in records if "clock" in r for c in r["clients"])
    return {
        "name": name,
        "reached": reached,
        "final": records[-1].get("test_accuracy"),
        "steps": len(records),
        "run_seconds": elapsed,
        "total": total,
        "staleness": staleness,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--slowdown", type=float, default=20.0, help="the fastest client's slowdown (8x: slowest)")
    parser.add_argument("--buffer", type=int, default=3, help="FedBuff's K")
    parser.add_argument("--rounds", type=int, default=25, help="synchronous FedAvg rounds")
    parser.add_argument("--steps", type=int, default=120, help="FedBuff server steps")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        results = [
            run("fedavg", [f"rounds={args.rounds}"], args, out),
            run("fedbuff", [f"rounds={args.steps}", "asynchronous.enabled=true",
                            f"asynchronous.buffer_size={args.buffer}"], args, out),
        ]
    print(f"10 gRPC client processes, speeds 1-8x (slowdown {args.slowdown:g}), target accuracy {args.target}")
    print(f"{'run':8} {'to target (s)':>14} {'steps':>6} {'final acc':>9} {'run (s)':>8} {'with start-up (s)':>18}")
    for r in results:
        to = "not reached" if r["reached"] is None else f"{r['reached'][0]:.1f}"
        at = "-" if r["reached"] is None else str(r["reached"][1])
        print(f"{r['name']:8} {to:>14} {at:>6} {r['final']:>9.4f} {r['run_seconds']:>8.1f} {r['total']:>18.1f}")
    staleness = results[1]["staleness"]
    count = sum(staleness.values())
    shown = ", ".join(f"{tau}: {n} ({n / count:.0%})" for tau, n in sorted(staleness.items()))
    mean = sum(tau * n for tau, n in staleness.items()) / max(count, 1)
    print(f"FedBuff staleness of the {count} applied updates (server steps: count): {shown}; mean {mean:.2f}")
    sync, buff = results[0]["reached"], results[1]["reached"]
    if sync is not None and buff is not None:
        print(f"wall time to {args.target} accuracy, FedAvg / FedBuff: {sync[0] / buff[0]:.2f}x")


if __name__ == "__main__":
    main()
