"""Heterogeneity-aware federated learning on emulated unlike clients (virtual clock).

Workload: scikit-learn's digits (1,437 training / 360 test images), an MLP, 10 clients
with a Dirichlet(alpha=1) label split (``--alpha``), every client every round, plain local SGD
(batch 16, lr 0.05). Each client's speed is drawn uniformly from 1-8x (seeded,
``heterogeneity.speed_range``) and time runs on the **virtual clock**
(``heterogeneity.clock: virtual``): a client's compute time is
``samples x 1 ms / speed``, deterministic, so the printed times do not depend on the
load of the machine, and the benchmark takes a few minutes on 2 shared cores (real
sleeps would take ~30x longer; the models still really train). Communication takes
no virtual time.

Runs, for the same number of client updates (rounds x 10 / K server steps for FedBuff):

- ``fixed``: every client ``--epochs`` local epochs, FedAvg (the round waits for the
  slowest client);
- ``adaptive+fednova``: ``controller: adaptive`` (local steps from each client's
  measured speed; target = the median time of the first round), FedNova;
- ``adaptive+fedavg``: the same plans, FedAvg (unnormalised: fast clients, taking more
  steps, weigh more);
- ``fedbuff``: buffered asynchronous aggregation, K = ``--buffer`` of 10 concurrent
  clients, staleness 1/sqrt(1 + t), fixed local epochs;
- ``fedbuff+adaptive``: the same with the adaptive controller;
- ``uniform-k3``: 3 of the 10 clients a round (``sample_fraction: 0.3``), drawn uniformly;
- ``oort-k3``: 3 a round chosen by Oort (``selection: oort``: high training loss, fast clients,
  a decaying share exploring): the same number of rounds, so fewer client updates than ``fixed``.

Printed: mean virtual time per round after the first (the controller measures in the
first), the virtual time to reach each test-accuracy target and its ratio to
``fixed``, final and best accuracy, local samples processed in all, wall seconds.

    python benchmarks/heterogeneous_fl.py [--rounds 60] [--epochs 2] [--buffer 5] [--alpha 1] [--seeds 0,1,2]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from fedweave import config as config_mod
from fedweave import runner
from fedweave.topologies.emulated import client_speeds

CLIENTS = 10

BASE = [
    "name=heterogeneous-fl-bench",
    f"clients={CLIENTS}",
    "task.dataset=digits",
    "task.model=mlp",
    "local.batch_size=16",
    "local.lr=0.05",
    "heterogeneity.speed_range=[1, 8]",
    "heterogeneity.clock=virtual",
    "eval.every=1",
    "eval.federated_every=0",
    "checkpoint.every=0",
]

RUNS = {
    "fixed": [],
    "adaptive+fednova": ["controller=adaptive", "strategy=fednova"],
    "adaptive+fedavg": ["controller=adaptive"],
    "fedbuff": ["asynchronous.enabled=true"],
    "fedbuff+adaptive": ["asynchronous.enabled=true", "controller=adaptive"],
    "uniform-k3": ["sample_fraction=0.3"],
    "oort-k3": ["sample_fraction=0.3", "selection=oort"],
}


def run(name: str, seed: int, rounds: int, epochs: int, buffer: int, alpha: float, out: Path) -> dict[str, Any]:
    if name.startswith("fedbuff"):
        rounds = rounds * CLIENTS // buffer  # as many client updates as the synchronous runs
    overrides = [*BASE, f"seed={seed}", f"rounds={rounds}", f"local.epochs={epochs}", f"output_dir={out}"]
    overrides.append(f"task.partition={{scheme: dirichlet, alpha: {alpha}}}")
    overrides += [f"asynchronous.buffer_size={buffer}"] + RUNS[name]
    config = config_mod.load(None, overrides)
    started = time.perf_counter()
    records = runner.execute(runner.prepare(config, out / f"{name}-{seed}"))
    wall = time.perf_counter() - started
    clock, times = 0.0, []
    for record in records:
        clock = record["clock"] if "clock" in record else clock + record["round_time"]
        times.append(clock)
    return {
        "records": records,
        "times": times,
        "round_time": statistics.mean(r["round_time"] for r in records[1:]),
        "accuracy": [r["test_accuracy"] for r in records],
        "samples": sum(c["steps"] * c["batch"] for r in records for c in r["clients"]),
        "wall": wall,
        "speeds": client_speeds(config),
    }


def time_to(result: dict[str, Any], target: float) -> float | None:
    for t, accuracy in zip(result["times"], result["accuracy"]):
        if accuracy >= target:
            return t
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--epochs", type=int, default=2, help="local epochs of the fixed runs and of round 1")
    parser.add_argument("--buffer", type=int, default=5, help="FedBuff's K")
    parser.add_argument("--alpha", type=float, default=1.0, help="Dirichlet concentration of the label split")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--targets", default="0.90,0.94")
    parser.add_argument("--runs", default=",".join(RUNS))
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    seeds = [int(s) for s in args.seeds.split(",")]
    targets = [float(t) for t in args.targets.split(",")]
    names = args.runs.split(",")
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            for name in names:
                results[name].append(run(name, seed, args.rounds, args.epochs, args.buffer, args.alpha, Path(tmp)))
    print(
        f"digits, 10 clients, Dirichlet({args.alpha}), {args.rounds} rounds, {args.epochs} local epochs (fixed), "
        f"FedBuff K={args.buffer}, seeds {seeds}; virtual clock: samples x 1 ms / speed"
    )
    for seed, result in zip(seeds, results[names[0]]):
        print(f"seed {seed} speeds: {' '.join(f'{s:.1f}' for s in result['speeds'])}")
    header = f"{'run':<18} {'s/round':>8} {'ratio':>6}" + "".join(
        f" {'t@' + format(t, '.2f'):>8} {'ratio':>6}" for t in targets
    ) + f" {'final acc':>9} {'best acc':>8} {'samples':>8} {'wall s':>7}"
    print(header)
    base = results.get("fixed")

    def mean_time(name: str, target: float) -> float | None:
        times = [time_to(r, target) for r in results[name]]
        return None if any(t is None for t in times) else statistics.mean(times)  # type: ignore[arg-type]

    for name in names:
        rs = results[name]
        per_round = statistics.mean(r["round_time"] for r in rs)
        line = f"{name:<18} {per_round:8.3f}"
        line += f" {statistics.mean(b['round_time'] for b in base) / per_round:6.2f}" if base else f" {'':>6}"
        for target in targets:
            t = mean_time(name, target)
            b = mean_time("fixed", target) if base else None
            line += f" {t:8.2f}" if t is not None else f" {'-':>8}"
            line += f" {b / t:6.2f}" if t is not None and b is not None else f" {'-':>6}"
        line += f" {statistics.mean(r['accuracy'][-1] for r in rs):9.3f}"
        line += f" {statistics.mean(max(r['accuracy']) for r in rs):8.3f}"
        line += f" {statistics.mean(r['samples'] for r in rs) / 1e3:7.0f}k"
        line += f" {statistics.mean(r['wall'] for r in rs):7.1f}"
        print(line)
    print("s/round: mean virtual seconds per round after the first (FedBuff: per server step); ratio: fixed / run")
    print("t@x: mean virtual seconds to a test accuracy >= x (- : not reached by every seed); ratio: fixed / run")


if __name__ == "__main__":
    main()
