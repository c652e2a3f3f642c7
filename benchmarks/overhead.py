"""fedweave's overhead against a bare PyTorch loop doing the same FedAvg work.

Both sides train the same clients (same partition, same initial model, same batch
order) with plain SGD and average the deltas weighted by examples, then evaluate
the global model on the test set every round. fedweave also writes its metrics
line and an atomic checkpoint every round, which the bare loop does not: that is
part of the overhead measured.

    python benchmarks/overhead.py [--clients 10] [--rounds 10] [--repeats 3]

Prints the median time of each side and the ratio fedweave / bare.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fedweave import config as config_mod
from fedweave import runner
from fedweave.seeding import torch_generator
from fedweave.task import load_dataset


def fedweave_time(overrides: list[str], out: Path) -> tuple[float, dict]:
    config = config_mod.load(None, overrides)
    r = runner.prepare(config, out)
    start = time.perf_counter()
    records = runner.execute(r)
    return time.perf_counter() - start, records[-1]


def bare_time(overrides: list[str], out: Path) -> tuple[float, float]:
    """The same run as a bare loop: the data and model come from fedweave's own build
    (not timed), the rounds are plain PyTorch."""
    config = config_mod.load(None, overrides)
    r = runner.prepare(config, out)  # only to get identical data, partition and model
    runtime = r.parts.topology.transport.handler.__self__
    data, model, loss_fn = runtime.data, runtime.model, runtime.loss_fn
    global_params = {k: v.clone() for k, v in r.params.items()}
    local = config.local
    test = load_dataset(config.task.dataset, seed=config.seed, test_fraction=config.task.test_fraction)
    start = time.perf_counter()
    for rnd in range(1, config.rounds + 1):
        deltas, weights = [], []
        for cid in range(config.clients):
            model.load_state_dict(global_params)
            opt = torch.optim.SGD(model.parameters(), lr=local.lr, momentum=local.momentum)
            idx = data.train_idx[cid]
            x, y = data.x[idx], data.y[idx]
            n = len(idx)
            gen = torch_generator(config.seed, "client", rnd, cid)
            model.train()
            for _ in range(local.epochs):
                order = torch.randperm(n, generator=gen)
                for i in range(0, n, local.batch_size):
                    b = order[i : i + local.batch_size]
                    opt.zero_grad()
                    loss_fn(model(x[b]), y[b]).backward()
                    opt.step()
            state = model.state_dict()
            deltas.append({k: state[k] - global_params[k] for k in global_params})
            weights.append(n)
        total = sum(weights)
        global_params = {
            k: global_params[k] + sum(d[k] * (w / total) for d, w in zip(deltas, weights)) for k in global_params
        }
        model.load_state_dict(global_params)
        model.eval()
        with torch.no_grad():
            logits = model(test.x_test)
            accuracy = (logits.argmax(1) == test.y_test).double().mean().item()
            loss_fn(logits, test.y_test).item()
    return time.perf_counter() - start, accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dataset", default="mnist5k")
    args = parser.parse_args()
    overrides = [
        f"clients={args.clients}",
        f"rounds={args.rounds}",
        f"task.dataset={args.dataset}",
        "task.partition.scheme=iid",
        "local.epochs=1",
        "local.batch_size=32",
        "local.lr=0.05",
        "local.momentum=0.0",
        "eval.federated_every=0",
        "threads=1",
    ]
    torch.set_num_threads(1)
    fw, bare = [], []
    with tempfile.TemporaryDirectory() as tmp:
        bare_time(overrides, Path(tmp) / "warm")  # warm-up: imports, allocator, torch.optim's first use
        for i in range(args.repeats):
            t, last = fedweave_time(overrides, Path(tmp) / f"fw{i}")
            fw.append(t)
            t, bare_accuracy = bare_time(overrides, Path(tmp) / f"bare{i}")
            bare.append(t)
    f, b = statistics.median(fw), statistics.median(bare)
    print(f"workload: FedAvg, {args.dataset}, {args.clients} clients x {args.rounds} rounds, 1 local epoch, batch 32")
    print(f"fedweave  {f:7.3f} s   (final test accuracy {last['test_accuracy']:.4f})")
    print(f"bare loop {b:7.3f} s   (final test accuracy {bare_accuracy:.4f})")
    print(f"ratio fedweave / bare = {f / b:.3f}  (overhead {100 * (f / b - 1):+.1f} %)")


if __name__ == "__main__":
    main()
