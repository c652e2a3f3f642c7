"""Many clients: peak memory and time per round against total and sampled clients.

Each configuration runs in a fresh process (so its peak resident memory is its own)
with about 50 synthetic samples per client (40 to train, 10 in its local test split),
so a client's work is the same whatever the total. Time per round should follow the
number of *sampled* clients, not the total.

The first rows hold the whole synthetic training set (62 samples per client, of which
the global test set takes a fifth) and partition it; the rows marked *generated* use
``task.dataset_options.per_client: 50``: each client generates its own samples from the
seed when it trains (:mod:`fedweave.task.generated`), so a million clients need no
million-row array, and client sampling draws 100 ids without touching the others.

    python benchmarks/scale.py [--rounds 10] [--repeats 1]

Prints the median wall and CPU seconds per round (the first round left out) and the
peak resident memory of each configuration, then the ratios (of the medians over the
repeats, which run every case in turn).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time

CASES = [  # (total clients, sampled per round, generated per client)
    (100, 10, False),
    (1000, 10, False),
    (1000, 100, False),
    (1000, 100, True),
    (1_000_000, 100, True),
]


def child(total: int, sampled: int, rounds: int, generated: bool, out: str) -> None:
    from fedweave import config as config_mod
    from fedweave import runner

    data = (
        "{samples: 62000, features: 32, classes: 10, per_client: 50}"  # the test set of 1000 clients
        if generated
        else f"{{samples: {62 * total}, features: 32, classes: 10}}"
    )
    config = config_mod.load(
        None,
        [
            f"clients={total}",
            f"sample_fraction={sampled / total}",
            f"rounds={rounds}",
            "task.dataset=synthetic",
            f"task.dataset_options={data}",
            "task.partition.scheme=iid",
            "task.local_test_fraction=0.2",
            "eval.federated_every=0",
            "local.batch_size=10",
        ],
    )
    r = runner.prepare(config, out)
    times, cpu = [], [time.process_time()]

    def record(rec: dict) -> None:
        times.append(rec["wall_time"])
        cpu.append(time.process_time())

    runner.execute(r, record)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    per_round = statistics.median(times[1:] or times)  # the first round (lazy imports, caches) left out
    cpu_per_round = statistics.median(b - a for a, b in zip(cpu[1:-1], cpu[2:])) if len(cpu) > 2 else cpu[-1] - cpu[0]
    result = {"peak_mb": peak_mb, "per_round": per_round, "cpu_per_round": cpu_per_round}
    json.dump(result | {"accuracy": r.records[-1]["test_accuracy"]}, sys.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=1, help="run every case this many times, in turn")
    parser.add_argument("--child", nargs=4, type=int, metavar=("TOTAL", "SAMPLED", "ROUNDS", "GENERATED"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        total, sampled, rounds, generated = args.child
        child(total, sampled, rounds, bool(generated), args.out)
        return
    runs: dict[tuple[int, int, bool], list[dict]] = {case: [] for case in CASES}
    for repeat in range(args.repeats):  # every case once, then again: the machine's load falls on all alike
        for case in CASES:
            total, sampled, generated = case
            with tempfile.TemporaryDirectory() as tmp:
                start = time.perf_counter()
                done = subprocess.run(
                    [sys.executable, __file__, "--child", str(total), str(sampled), str(args.rounds),
                     str(int(generated)), "--out", tmp],
                    check=True, capture_output=True, text=True,
                )
                result = json.loads(done.stdout)
                result["process_s"] = time.perf_counter() - start
            runs[case].append(result)
            print(
                f"{total:9,d} clients, {sampled:4d} sampled{', generated' if generated else ''}: "
                f"{result['per_round'] * 1000:8.1f} ms/round ({result['cpu_per_round'] * 1000:7.1f} ms CPU), "
                f"peak memory {result['peak_mb']:7.1f} MB, whole process {result['process_s']:.1f} s, "
                f"accuracy {result['accuracy']:.4f}",
                flush=True,
            )
    rows = {
        case: {key: statistics.median(r[key] for r in results) for key in ("per_round", "cpu_per_round")}
        | {"peak_mb": max(r["peak_mb"] for r in results)}
        for case, results in runs.items()
    }
    if args.repeats > 1:
        print(f"medians over {args.repeats} repeats:")

    def ratio(a: tuple[int, int, bool], b: tuple[int, int, bool]) -> str:
        wall = rows[a]["per_round"] / rows[b]["per_round"]
        return f"{wall:.2f} (CPU x{rows[a]['cpu_per_round'] / rows[b]['cpu_per_round']:.2f})"

    print(f"time per round, 1000 vs 100 total clients (10 sampled each):           x{ratio((1000, 10, False), (100, 10, False))}")
    print(f"time per round, 100 vs 10 sampled (1000 total):                        x{ratio((1000, 100, False), (1000, 10, False))}")
    print(f"time per round, 1,000,000 generated vs 1000 clients (100 sampled each): x{ratio((1_000_000, 100, True), (1000, 100, False))}"
          f"; against 1000 generated x{ratio((1_000_000, 100, True), (1000, 100, True))}")
    print(f"peak memory with 1000 clients: {max(r['peak_mb'] for k, r in rows.items() if k[0] == 1000):.0f} MB, "
          f"with 1,000,000: {rows[1_000_000, 100, True]['peak_mb']:.0f} MB (limit 2048 MB)")


if __name__ == "__main__":
    main()
