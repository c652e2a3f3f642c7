"""Many clients: peak memory and time per round against total and sampled clients.

Each configuration runs in a fresh process (so its peak resident memory is its own)
with 50 synthetic samples per client, so a client's work is the same whatever the
total. Time per round should follow the number of *sampled* clients, not the total.

    python benchmarks/scale.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time

CASES = [  # (total clients, sampled per round)
    (100, 10),
    (1000, 10),
    (1000, 100),
]


def child(total: int, sampled: int, rounds: int, out: str) -> None:
    from fedweave import config as config_mod
    from fedweave import runner

    config = config_mod.load(
        None,
        [
            f"clients={total}",
            f"sample_fraction={sampled / total}",
            f"rounds={rounds}",
            "task.dataset=synthetic",
            f"task.dataset_options={{samples: {62 * total}, features: 32, classes: 10}}",
            "task.partition.scheme=iid",
            "task.local_test_fraction=0.2",
            "eval.federated_every=0",
            "local.batch_size=10",
        ],
    )
    r = runner.prepare(config, out)
    times = []
    runner.execute(r, lambda rec: times.append(rec["wall_time"]))
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    per_round = sum(times[1:]) / max(1, len(times) - 1)
    json.dump({"peak_mb": peak_mb, "per_round": per_round, "accuracy": r.records[-1]["test_accuracy"]}, sys.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", nargs=3, type=int, metavar=("TOTAL", "SAMPLED", "ROUNDS"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child, args.out)
        return
    rows = []
    for total, sampled in CASES:
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            done = subprocess.run(
                [sys.executable, __file__, "--child", str(total), str(sampled), str(args.rounds), "--out", tmp],
                check=True, capture_output=True, text=True,
            )
            result = json.loads(done.stdout)
            result["process_s"] = time.perf_counter() - start
        rows.append((total, sampled, result))
        print(
            f"{total:5d} clients, {sampled:4d} sampled: {result['per_round'] * 1000:8.1f} ms/round, "
            f"peak memory {result['peak_mb']:7.1f} MB, whole process {result['process_s']:.1f} s"
        )
    base = rows[0][2]["per_round"]
    print(f"time per round, 1000 vs 100 total clients (10 sampled each): x{rows[1][2]['per_round'] / base:.2f}")
    print(f"time per round, 100 vs 10 sampled (1000 total):              x{rows[2][2]['per_round'] / rows[1][2]['per_round']:.2f}")
    print(f"peak memory with 1000 clients: {max(r[2]['peak_mb'] for r in rows[1:]):.0f} MB (limit 2048 MB)")


if __name__ == "__main__":
    main()
