"""Per-round time with ``simulation.workers`` processes against one process doing the clients' work.

Each row trains one federation once per worker count (``--workers``, default 1 and 2) in this
process, from the same seed, every client sampled every round; their rounds are interleaved
(round r with 1 worker, then with 2, ...) so that the machine's load falls on all alike, and the
first round of each (the workers' start-up is before it; lazy imports, caches) is left out. A
round's time is :func:`fedweave.federated.rounds.train_round`'s wall time. Printed per row and
worker count: the median seconds of a round, the median of the per-round ratios (one process's
time / this count's: the speed-up) with its interquartile range, and the largest absolute
difference of the final model from one process's (0: bit for bit, what the workers promise on a
CPU for the sequential loop and for cohorts on the MLP fast path, docs/simulation.md).

    python benchmarks/workers.py [--rounds 6] [--workers 1 2 4] [--device cpu|cuda] [--only digits-100 ...]

``--device cuda`` trains on CUDA, the workers round-robin over the machine's CUDA devices (each
worker one device: the scaling with several GPUs). Each worker process runs torch on one thread
(config ``threads=1``), as one process does, so that N workers use N cores. Rows: digits with the
MLP, 100 clients in cohorts (the per-client message path, which stays in the main process, weighs
most); MNIST-5k with the CNN, 50 clients (one after another on a CPU, in cohorts on a GPU); a wide
MLP on synthetic data, 16 clients of 1,250 rows (each client's own training weighs most).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from fedweave import config as config_mod
from fedweave import runner
from fedweave.federated.rounds import train_round
from spread import load_average, ratio_spread

BASE = [
    "sample_fraction=1.0",
    "eval.every=0",
    "eval.federated_every=0",
    "checkpoint.every=0",
    "seed=0",
    "threads=1",
    "task.partition={scheme: dirichlet, alpha: 0.5}",
]
ROWS = {
    "digits-100": ["task.dataset=digits", "task.model=mlp", "clients=100"],
    "mnist5k-cnn-50": ["task.dataset=mnist5k", "task.model=cnn", "clients=50", "local={epochs: 1, batch_size: 16, lr: 0.01}"],
    "wide-mlp-16": [
        "task.dataset=synthetic",
        "task.dataset_options={samples: 20000, features: 256, classes: 10}",
        "task.model_options={hidden: [512, 512]}",
        "task.partition=iid",
        "clients=16",
        "local={epochs: 1, batch_size: 32, lr: 0.05, momentum: 0.9}",
    ],
}


def paired(overrides: list[str], counts: list[int], rounds: int, device: str, out: Path) -> dict[int, dict[str, float]]:
    """Per worker count: median seconds of a round, the per-round speed-ups' median and quartiles, |Δ| of the model."""
    runs = {
        n: runner.prepare(
            config_mod.load(None, [*BASE, *overrides, f"simulation.workers={n}", f"local.device={device}"]), out / str(n)
        )
        for n in counts
    }
    try:
        params = {n: r.params for n, r in runs.items()}
        seconds: dict[int, list[float]] = {n: [] for n in counts}
        for rnd in range(1, rounds + 2):
            for n, r in runs.items():
                torch.set_num_threads(1)
                started = time.perf_counter()
                params[n], _ = train_round(r.parts, rnd, params[n])
                if device == "cuda":
                    torch.cuda.synchronize()
                seconds[n].append(time.perf_counter() - started)
    finally:
        for r in runs.values():
            r.parts.topology.close()
    one, first = seconds[counts[0]][1:], params[counts[0]]
    out_rows: dict[int, dict[str, float]] = {}
    for n in counts:
        ratio, q1, q3 = ratio_spread([a / b for a, b in zip(one, seconds[n][1:])])
        out_rows[n] = {
            "seconds": statistics.median(seconds[n][1:]),
            "ratio": ratio,
            "q1": q1,
            "q3": q3,
            "diff": max(
                float((first[k].double() - params[n][k].double()).abs().max()) for k in first if first[k].is_floating_point()
            ),
        }
    return out_rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="measured rounds per worker count (after one left out)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts; the first is the reference")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="local.device of every run")
    parser.add_argument("--only", nargs="*", choices=list(ROWS), help="rows to run (default: all)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks/workers.py: this machine has no CUDA device, so there is no cuda run to measure")
        return 0
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    print(f"torch {torch.__version__}; {os.cpu_count()} CPUs; device {args.device}"
          f"{f' ({gpus} CUDA devices)' if gpus else ''}; workers {' '.join(map(str, args.workers))}; "
          f"{args.rounds} rounds each; load average {load_average()}")
    print(f"{'row':<16} {'workers':>7} {'s/round':>9} {'speed-up':>9} {'IQR':>13} {'max |Δ|':>9}")
    with tempfile.TemporaryDirectory() as out:
        for name in args.only or ROWS:
            rows = paired(ROWS[name], args.workers, args.rounds, args.device, Path(out) / name)
            for n, m in rows.items():
                print(f"{name:<16} {n:>7} {m['seconds']:>9.4f} {m['ratio']:>8.2f}x {m['q1']:>6.2f}-{m['q3']:<6.2f} "
                      f"{m['diff']:>9.2e}", flush=True)
    print(f"load average after: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
