"""Dynamic batching against static equal batches, with real worker processes on loopback.

Three gloo workers on 127.0.0.1 train a small CNN on MNIST-5k (compute-bound: about
6.6 MFLOP per sample against 0.4 MB of gradient per step) with emulated speeds
1:2:4 and the same global batch B and learning rate in both runs. Because each step
is the gradient of the same global batch whatever the split (the b_i / B weighting),
both runs take the same sequence of steps and reach the same accuracy; only the time
differs.

Printed per run, for the epochs after the first (the controller settles during the
first; its time is printed too):

- epoch time: rank 0's wall time of the epoch's steps (evaluation excluded);
- ideal: S · (B / Σ X_i + c) summed over the epoch's steps, i.e. N / Σ X_i + S · c,
  with X_i each worker's measured throughput (samples per second of compute) and c
  the measured communication time per step;
- efficiency = ideal / epoch time, speed-up = static / dynamic (ideal 7/3 = 2.33 at
  1:2:4), controller overhead = time in the controller / wall time;
- time to accuracy: wall time until the test accuracy first reaches the target.

    python benchmarks/dynamic_batching.py [--epochs 6] [--slowdown 2] [--target 0.9]

``--slowdown`` runs the fastest emulated worker that many times slower than native,
so that the emulated cluster fits the cores: speeds 1:2:4 keep Σ 1/f_i = 1.75 / slowdown
cores busy (see docs/heterogeneity.md).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
from pathlib import Path
from typing import Any

from fedweave import config as config_mod
from fedweave import data_parallel

BASE = [
    "mode=data_parallel",
    "name=dynamic-batching-bench",
    "task.dataset=mnist5k",
    "task.model=cnn",
    "task.model_options={channels: [16, 32], hidden: 64}",
    "data_parallel.workers=3",
    "data_parallel.global_batch=224",
    "data_parallel.lr=0.05",
    "data_parallel.momentum=0.9",
    "data_parallel.log_every=100000",  # one metrics line per epoch
    "data_parallel.controller.every=3",
    "data_parallel.controller.dead_band=0.02",  # emulated speeds are steady: balance more tightly
    "data_parallel.timeout=60",
    "heterogeneity.speeds=[1, 2, 4]",
    "checkpoint.every=0",
]


def run(policy: str, epochs: int, slowdown: float, out: Path) -> list[dict[str, Any]]:
    config = config_mod.load(
        None,
        [*BASE, f"data_parallel.epochs={epochs}", f"data_parallel.controller.policy={policy}",
         f"heterogeneity.slowdown={slowdown}"],
    )
    return data_parallel.execute(data_parallel.prepare(config, out / policy))


def epoch_stats(record: dict[str, Any], global_batch: int) -> dict[str, float]:
    """Measured and ideal time of one epoch's metrics line."""
    steps = record["samples"] / global_batch
    throughput = [b / t for b, t in zip(record["batch"], record["compute_time"])]
    comm = record["comm_time"] or 0.0
    ideal = record["samples"] / sum(throughput) + steps * comm
    return {
        "time": record["window_time"],
        "ideal": ideal,
        "comm": comm,
        "controller": record["controller_time"],
        "throughput": throughput,
    }


def time_to(records: list[dict[str, Any]], target: float) -> float | None:
    for record in records:
        if record.get("test_accuracy") is not None and record["test_accuracy"] >= target:
            return record["wall_time"]
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--slowdown", type=float, default=2.0)
    parser.add_argument("--target", type=float, default=0.9, help="test accuracy for time-to-accuracy")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    B = 224
    with tempfile.TemporaryDirectory() as tmp:
        results = {policy: run(policy, args.epochs, args.slowdown, Path(tmp)) for policy in ("dynamic", "static")}
    summary = {}
    for policy, records in results.items():
        stats = [epoch_stats(r, B) for r in records]
        steady = stats[1:]
        epoch = statistics.median(s["time"] for s in steady)
        ideal = statistics.median(s["ideal"] for s in steady)
        control = sum(s["controller"] for s in stats) / sum(s["time"] for s in stats)
        summary[policy] = {"epoch": epoch, "ideal": ideal, "first": stats[0]["time"], "control": control,
                           "records": records, "comm": statistics.median(s["comm"] for s in steady)}
        last = records[-1]
        print(
            f"{policy:>7}: epoch {epoch:.2f} s (first epoch {stats[0]['time']:.2f} s), "
            f"final batches {[round(b) for b in last['batch']]}, "
            f"throughput X_i {[round(x) for x in steady[-1]['throughput']]} samples/s, "
            f"comm {summary[policy]['comm'] * 1000:.1f} ms/step, controller {control:.3%} of wall time"
        )
    dyn, sta = summary["dynamic"], summary["static"]
    print(f"ideal S·(B/ΣX_i + c): {dyn['ideal']:.2f} s per epoch (from the dynamic run's measured X_i and c)")
    print(f"efficiency (ideal / dynamic epoch):  {dyn['ideal'] / dyn['epoch']:.1%}   target >= 95 %")
    print(f"speed-up (static / dynamic epoch):   {sta['epoch'] / dyn['epoch']:.2f}x   target >= 2.2x (ideal 2.33x)")
    print(f"controller overhead:                 {dyn['control']:.3%}   target <= 2 %")
    for policy in ("dynamic", "static"):
        records = summary[policy]["records"]
        accs = " ".join(f"{r['test_accuracy']:.3f}" for r in records)
        print(f"{policy:>7} test accuracy per epoch: {accs}; "
              f"time to {args.target:.2f}: {_fmt(time_to(records, args.target))}")
    t_dyn, t_sta = time_to(dyn["records"], args.target), time_to(sta["records"], args.target)
    if t_dyn and t_sta:
        print(f"time-to-accuracy ratio (static / dynamic): {t_sta / t_dyn:.2f}x; final accuracy "
              f"{dyn['records'][-1]['test_accuracy']:.4f} dynamic vs {sta['records'][-1]['test_accuracy']:.4f} static")


def _fmt(seconds: float | None) -> str:
    return "not reached" if seconds is None else f"{seconds:.1f} s"


if __name__ == "__main__":
    main()
