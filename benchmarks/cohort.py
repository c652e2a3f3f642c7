"""Per-round time of a round's clients trained one after another against vectorised cohorts.

Each row trains one federation twice in this process from the same seed, once with
``simulation.cohort: off`` (the sequential loop) and once with ``simulation.cohort: K``, K the
clients per round (one vectorised group of the round's clients, :mod:`fedweave.cohort`; ``auto``
would leave the CNN rows on a CPU to the sequential loop), every client sampled every
round. Their rounds are interleaved in pairs (sequential round r, then cohort round r) so that
the machine's load falls on both alike; the first pair (lazy imports, caches) is left out. A
round's time is :func:`fedweave.federated.rounds.train_round`'s wall time (configure, the clients' work,
checks, aggregation; no evaluation). Printed per row: the median seconds of a round on each path,
the median of the per-pair ratios sequential / cohort with its interquartile range, and the
largest relative difference between the two final models (float rounding: the cohort's matrix
products are batched), and the median share of a cohort round its clients' vectorised training
took (the sum of their recorded compute times; the rest is the round's message path: configure,
open, jobs, checks, aggregation). The load average of the machine is printed before and after.

    python benchmarks/cohort.py [--pairs 8] [--only digits-10 mnist5k-cnn-50 ...] [--threads 1] [--cohort-threads 2]
                                [--partition dirichlet iid] [--device cpu|cuda]

``--threads`` is both paths' config ``threads`` (torch's intra-op threads); ``--cohort-threads``
gives the cohort side its own (each path's count set before each of its rounds), so that each
path can be read at its best on a machine: the sequential loop's small operations are fastest
on one thread, a cohort's stacked ones gain from more. ``--device cuda`` trains both paths on
CUDA (``local.device``; on a machine without it the script says so in one line and exits 0).

Rows: digits with the MLP (the quickstart's local settings: 3 epochs, batch 16, lr 0.1, momentum
0.9) and MNIST-5k with the CNN (1 epoch, batch 16, lr 0.01), 10, 50 and 100 clients per round, a
Dirichlet(0.5) partition (unequal clients: a cohort takes as many steps as its largest client) or
an iid one (``--partition iid``: equal clients), or each in turn.
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
]
PARTITIONS = {"dirichlet": "task.partition={scheme: dirichlet, alpha: 0.5}", "iid": "task.partition=iid"}
TASKS = {
    "digits": ["task.dataset=digits", "task.model=mlp"],
    # One epoch at lr 0.01 without momentum: at the quickstart's lr 0.1 and momentum 0.9 the CNN's training is
    # chaotic enough on MNIST to turn the paths' 1e-7 rounding differences into 1e-3 after a round.
    "mnist5k-cnn": ["task.dataset=mnist5k", "task.model=cnn", "local={epochs: 1, batch_size: 16, lr: 0.01}"],
}

ROWS = {f"{task}-{k}": (k, [*overrides, f"clients={k}"]) for task, overrides in TASKS.items() for k in (10, 50, 100)}


def paired(
    k: int, overrides: list[str], pairs: int, threads: dict[str, int], partition: str, device: str, out: Path
) -> dict[str, float]:
    given = [*BASE, PARTITIONS[partition], *overrides, f"local.device={device}"]
    runs = {
        mode: runner.prepare(
            config_mod.load(None, [*given, f"threads={threads[mode]}", f"simulation.cohort={cohort}"]), out / mode
        )
        for mode, cohort in (("off", "off"), ("auto", k))
    }
    params = {mode: r.params for mode, r in runs.items()}
    seconds: dict[str, list[float]] = {"off": [], "auto": []}
    training: list[float] = []  # per cohort round: the share of its time its clients' training took
    for rnd in range(1, pairs + 2):
        for mode, r in runs.items():
            torch.set_num_threads(threads[mode])  # a process's setting: each path's before each of its rounds
            started = time.perf_counter()
            params[mode], record = train_round(r.parts, rnd, params[mode])
            if device == "cuda":
                torch.cuda.synchronize()
            seconds[mode].append(time.perf_counter() - started)
            if mode == "auto":
                training.append(sum(c["compute"] for c in record["clients"]) / seconds[mode][-1])
    off, auto = seconds["off"][1:], seconds["auto"][1:]
    ratio, q1, q3 = ratio_spread([a / b for a, b in zip(off, auto)])
    a, b = params["off"], params["auto"]
    return {
        "off": statistics.median(off),
        "auto": statistics.median(auto),
        "ratio": ratio,
        "q1": q1,
        "q3": q3,
        "training": statistics.median(training[1:]),
        "diff": max(
            float((a[k].double() - b[k].double()).abs().max() / a[k].double().abs().max().clamp_min(1e-12))
            for k in a
            if a[k].is_floating_point()
        ),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=8, help="measured pairs of rounds (after one left out)")
    parser.add_argument("--only", nargs="*", choices=list(ROWS), help="rows to run (default: all)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of both paths (config threads)")
    parser.add_argument("--cohort-threads", type=int, help="torch threads of the cohort side (default: --threads)")
    parser.add_argument("--partition", nargs="+", choices=list(PARTITIONS), default=["dirichlet"],
                        help="how the data is split: Dirichlet(0.5) (unequal clients), iid (equal), or both")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="local.device of both paths")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks/cohort.py: this machine has no CUDA device, so there is no cuda run to measure")
        return 0
    threads = {"off": args.threads, "auto": args.threads if args.cohort_threads is None else args.cohort_threads}
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"{os.cpu_count()} CPUs"
    print(f"torch {torch.__version__}; {where}; threads: sequential {threads['off']}, cohort "
          f"{threads['auto']}; {args.pairs} pairs per row; "
          f"load average {load_average()}")
    print(f"{'row':<28} {'seq s':>8} {'cohort s':>9} {'seq/cohort':>11} {'IQR':>13} {'max rel |Δ|':>12} {'training':>9}")
    with tempfile.TemporaryDirectory() as out:
        for partition in args.partition:
            for name in args.only or ROWS:
                m = paired(*ROWS[name], args.pairs, threads, partition, args.device, Path(out) / partition / name)
                print(f"{name + ' ' + partition:<28} {m['off']:>8.4f} {m['auto']:>9.4f} {m['ratio']:>10.2f}x "
                      f"{m['q1']:>6.2f}-{m['q3']:<6.2f} {m['diff']:>12.2e} {m['training']:>8.0%}", flush=True)
    print(f"load average after: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
