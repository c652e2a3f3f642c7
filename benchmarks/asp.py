"""Asynchronous parameter server (asp) against synchronous steps (bsp), at speeds 1:2:4.

Three gloo workers on 127.0.0.1 train the MNIST-5k CNN with emulated speeds 1:2:4 and
the same global batch B, learning rate and momentum in every run:

- bsp: synchronous steps, dynamic batches (every step waits for the slowest worker's
  share; the controller balances the shares);
- asp: the parameter server applies each worker's gradient as it arrives, weighted by
  b_i / B and 1/√(1 + staleness), dynamic batches (equal update rates);
- asp-static: the same with equal batches (update rates 1:2:4).

Printed per run: the test accuracy at each epoch's end, the wall time to reach the
target accuracy and its ratio to bsp's (same machine, same moment), and for the asp
runs each worker's share of the updates and mean staleness.

    python benchmarks/asp.py [--epochs 5] [--slowdown 2] [--target 0.85]
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path
from typing import Any

from fedweave import config as config_mod
from fedweave import data_parallel

BASE = [
    "mode=data_parallel",
    "name=asp-bench",
    "task.dataset=mnist5k",
    "task.model=cnn",
    "task.model_options={channels: [16, 32], hidden: 64}",
    "data_parallel.workers=3",
    "data_parallel.global_batch=224",
    "data_parallel.lr=0.05",
    "data_parallel.momentum=0.9",
    "data_parallel.log_every=100000",
    "data_parallel.controller.every=3",
    "data_parallel.timeout=60",
    "heterogeneity.speeds=[1, 2, 4]",
    "checkpoint.every=0",
]

RUNS = {
    "bsp": ["data_parallel.sync=bsp"],
    "asp": ["data_parallel.sync=asp"],
    "asp-static": ["data_parallel.sync=asp", "data_parallel.controller=static"],
}


def run(name: str, epochs: int, slowdown: float, out: Path) -> list[dict[str, Any]]:
    config = config_mod.load(
        None, [*BASE, *RUNS[name], f"data_parallel.epochs={epochs}", f"heterogeneity.slowdown={slowdown}"]
    )
    return data_parallel.execute(data_parallel.prepare(config, out / name))


def time_to(records: list[dict[str, Any]], target: float) -> float | None:
    for record in records:
        if record.get("test_accuracy") is not None and record["test_accuracy"] >= target:
            return record["wall_time"]
    return None


def per_worker(records: list[dict[str, Any]]) -> tuple[dict[int, int], dict[int, float]]:
    """Updates and mean staleness per worker over the whole run (asp records)."""
    updates: dict[int, int] = {}
    stale: dict[int, float] = {}
    for record in records:
        for w, u, s in zip(record["workers"], record["updates"], record["staleness"]):
            updates[w] = updates.get(w, 0) + u
            stale[w] = stale.get(w, 0.0) + s * u
    return updates, {w: stale[w] / updates[w] for w in updates}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--slowdown", type=float, default=2.0)
    parser.add_argument("--target", type=float, default=0.85, help="test accuracy for time-to-accuracy")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: run(name, args.epochs, args.slowdown, Path(tmp)) for name in RUNS}
    reference = time_to(results["bsp"], args.target)
    for name, records in results.items():
        accs = " ".join(f"{r['test_accuracy']:.3f}" for r in records if r.get("test_accuracy") is not None)
        reached = time_to(records, args.target)
        ratio = f"{reference / reached:.2f}x bsp" if reached and reference else "-"
        print(f"{name:>10}: accuracy per epoch {accs}; wall {records[-1]['wall_time']:.1f} s; "
              f"time to {args.target:.2f}: {_fmt(reached)} ({ratio})")
        if name != "bsp":
            updates, stale = per_worker(records)
            total = sum(updates.values())
            print(f"{'':>10}  updates per worker {[updates[w] for w in sorted(updates)]} "
                  f"(max/min {max(updates.values()) / min(updates.values()):.2f}, {total} in all); "
                  f"mean staleness per worker {[round(stale[w], 2) for w in sorted(stale)]}")


def _fmt(seconds: float | None) -> str:
    return "not reached" if seconds is None else f"{seconds:.1f} s"


if __name__ == "__main__":
    main()
