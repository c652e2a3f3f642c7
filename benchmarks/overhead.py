"""fedweave's overhead against a bare PyTorch loop doing the same FedAvg work.

Both sides train the same clients (same partition, same initial model, same batch
order) with plain SGD (the bare loop writes the update out, as fedweave does, rather than
pay ``torch.optim``'s per-step bookkeeping, and gathers rows with ``index_select``, as
fedweave does, rather than pay advanced indexing's set-up, ~7 µs a batch) and average the deltas weighted by examples, then evaluate
the global model on the test set every round. fedweave also writes its metrics
line every round and its checkpoint at the config's cadence (``checkpoint.every``,
``--checkpoint-every``; at most one per ``checkpoint.min_interval`` seconds, 30 by default in
simulation, ``--checkpoint-min-interval``; the last round's always), which the bare loop does
not: that is part of the overhead measured.

    python benchmarks/overhead.py [--clients 10] [--rounds 10] [--pairs 10]

The two sides run interleaved (fedweave, bare, fedweave, bare, ...) so that the
machine's load falls on both alike; each pair gives one ratio fedweave / bare. Prints
the median of the per-pair ratios of wall seconds and of CPU seconds (this process's,
steadier on a shared machine; it leaves out waiting, such as a checkpoint's fsync) with
their spread (min, quartiles, max), and both
final test accuracies, which must agree to the last digit (exit status 1 otherwise).
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


Seconds = tuple[float, float]  # wall, CPU of this process


def fedweave_time(overrides: list[str], out: Path) -> tuple[Seconds, dict]:
    config = config_mod.load(None, overrides)
    r = runner.prepare(config, out)
    start, cpu = time.perf_counter(), time.process_time()
    records = runner.execute(r)
    return (time.perf_counter() - start, time.process_time() - cpu), records[-1]


def bare_time(overrides: list[str], out: Path) -> tuple[Seconds, float]:
    """The same run as a bare loop: the data and model come from fedweave's own build
    (not timed), the rounds are plain PyTorch."""
    config = config_mod.load(None, overrides)
    r = runner.prepare(config, out)  # only to get identical data, partition and model
    runtime = r.parts.topology.transport.handler.__self__
    data, model, loss_fn = runtime.data, runtime.model, runtime.loss_fn
    global_params = {k: v.clone() for k, v in r.params.items()}
    local = config.local
    test = load_dataset(config.task.dataset, seed=config.seed, test_fraction=config.task.test_fraction)
    start, cpu = time.perf_counter(), time.process_time()
    for rnd in range(1, config.rounds + 1):
        deltas, weights = [], []
        for cid in range(config.clients):
            model.load_state_dict(global_params)
            momentum: dict[torch.nn.Parameter, torch.Tensor] = {}
            idx = data.train_idx[cid]
            x, y = data.x.index_select(0, idx), data.y.index_select(0, idx)
            n = len(idx)
            gen = torch_generator(config.seed, "client", rnd, cid)
            model.train()
            for _ in range(local.epochs):
                order = torch.randperm(n, generator=gen)
                for i in range(0, n, local.batch_size):
                    b = order[i : i + local.batch_size]
                    model.zero_grad(set_to_none=True)
                    loss_fn(model(x.index_select(0, b)), y.index_select(0, b)).backward()
                    with torch.no_grad():  # SGD as torch.optim.SGD computes it, without its bookkeeping
                        for p in model.parameters():
                            g = p.grad
                            if local.momentum:
                                g = momentum[p] = g.clone() if p not in momentum else momentum[p].mul_(local.momentum).add_(g)
                            p.add_(g, alpha=-local.lr)
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
    return (time.perf_counter() - start, time.process_time() - cpu), accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--dataset", default="mnist5k")
    parser.add_argument("--checkpoint-every", type=int, default=None, help="fedweave's checkpoint.every (default: the config's)")
    parser.add_argument(
        "--checkpoint-min-interval", type=float, default=None, help="fedweave's checkpoint.min_interval (default: the config's)"
    )
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
        "simulation.cohort=off",  # the bare loop trains one client after another: so does fedweave here
    ]
    if args.checkpoint_every is not None:
        overrides.append(f"checkpoint.every={args.checkpoint_every}")
    if args.checkpoint_min_interval is not None:
        overrides.append(f"checkpoint.min_interval={args.checkpoint_min_interval}")
    torch.set_num_threads(1)
    seconds: dict[str, list[Seconds]] = {"fedweave": [], "bare": []}
    accuracies = set()
    with tempfile.TemporaryDirectory() as tmp:
        bare_time(overrides, Path(tmp) / "warm")  # warm-up: imports, allocator, first use of each kernel
        fedweave_time(overrides, Path(tmp) / "warm-fw")
        for i in range(args.pairs):
            f, last = fedweave_time(overrides, Path(tmp) / f"fw{i}")
            b, bare_accuracy = bare_time(overrides, Path(tmp) / f"bare{i}")
            seconds["fedweave"].append(f)
            seconds["bare"].append(b)
            accuracies |= {last["test_accuracy"], bare_accuracy}
            print(
                f"pair {i + 1:2d}: wall fedweave {f[0]:6.3f} s, bare {b[0]:6.3f} s, ratio {f[0] / b[0]:.3f};  "
                f"CPU fedweave {f[1]:6.3f} s, bare {b[1]:6.3f} s, ratio {f[1] / b[1]:.3f}",
                flush=True,
            )
    print(f"workload: FedAvg, {args.dataset}, {args.clients} clients x {args.rounds} rounds, 1 local epoch, batch 32")
    print(f"final test accuracy: fedweave {last['test_accuracy']!r}, bare loop {bare_accuracy!r}")
    for what, i in (("wall", 0), ("CPU", 1)):
        fw, bare = [s[i] for s in seconds["fedweave"]], [s[i] for s in seconds["bare"]]
        ratios = [f / b for f, b in zip(fw, bare)]
        q1, median, q3 = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
        print(
            f"{what:4s} fedweave / bare, median of {len(ratios)} paired ratios = {median:.3f} "
            f"(min {min(ratios):.3f}, IQR {q1:.3f}-{q3:.3f}, max {max(ratios):.3f}); "
            f"medians {statistics.median(fw):.3f} s / {statistics.median(bare):.3f} s"
        )
    if len(accuracies) != 1:
        print(f"MISMATCH: the runs ended at different accuracies {sorted(accuracies)}")
        raise SystemExit(1)
    print("both sides reach the same accuracy in every pair, to the last digit")


if __name__ == "__main__":
    main()
