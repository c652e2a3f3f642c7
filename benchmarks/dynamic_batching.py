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

The two policies run interleaved, ``--repeats`` pairs (the order alternating: dynamic, static,
static, dynamic, ...), so a change of the host's load between them shows as spread, not as a
speed-up: each pair's speed-up is printed, then their median and range. A speed-up above the
ideal Σ s_i / (n · min s_i) is impossible on an unchanged machine and is flagged INVALID (the
load changed during that pair), as is a median above it.

    python benchmarks/dynamic_batching.py [--epochs 6] [--slowdown 2] [--target 0.9] [--repeats 3]

``--slowdown`` runs the fastest emulated worker that many times slower than native,
so that the emulated cluster fits the cores: speeds 1:2:4 keep Σ 1/f_i = 1.75 / slowdown
cores busy (see docs/heterogeneity.md).

``--hosts 3`` runs each worker on a host of its own: three network namespaces on a
bridge (root and iproute2), one torchrun agent each, the rendezvous on host 0
(docs/heterogeneity.md, *Across hosts*). It then also measures a world change: the
seconds from a SIGKILL of one host to the survivors' next step under torchrun (the
survivors' workers restart and resume from the job's saved state) against the
in-place re-formation of one host's launcher (``fedweave run``, a worker SIGKILLed).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fedweave import config as config_mod
from fedweave import data_parallel
from fedweave.observe.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the network namespaces of the multi-host tests

import netns  # noqa: E402

RDZV_CONF = "join_timeout=120,last_call_timeout=1,close_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3"

SPEEDS = (1, 2, 4)
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
    f"heterogeneity.speeds={list(SPEEDS)}",
    "checkpoint.every=0",
]


def ideal_speedup(speeds: tuple[float, ...]) -> float:
    """Static equal batches wait for the slowest worker each step; dynamic ones, at best, keep every
    worker busy: Σ s_i / (n · min s_i) (7/3 at 1:2:4), communication left out (it only lowers it)."""
    return sum(speeds) / (len(speeds) * min(speeds))


def interleaved(repeats: int) -> list[tuple[int, str]]:
    """(pair, policy) in the order they run: the order alternates, so neither policy always runs first."""
    pairs = [("dynamic", "static") if k % 2 == 0 else ("static", "dynamic") for k in range(repeats)]
    return [(k, policy) for k, pair in enumerate(pairs) for policy in pair]


def speedups(static: list[float], dynamic: list[float], ideal: float) -> dict[str, Any]:
    """Each pair's speed-up (static / dynamic epoch time), their median and range, and the pairs (by
    index) whose speed-up exceeds ``ideal``, which no unchanged machine can give."""
    ratios = [s / d for s, d in zip(static, dynamic, strict=True)]
    return {"ratios": ratios, "median": statistics.median(ratios), "low": min(ratios), "high": max(ratios),
            "invalid": [k for k, r in enumerate(ratios) if r > ideal]}


def run(policy: str, epochs: int, slowdown: float, out: Path) -> list[dict[str, Any]]:
    config = config_mod.load(
        None,
        [*BASE, f"data_parallel.epochs={epochs}", f"data_parallel.controller.policy={policy}",
         f"heterogeneity.slowdown={slowdown}"],
    )
    return data_parallel.execute(data_parallel.prepare(config, out / policy))


def run_hosts(hosts: netns.Hosts, overrides: list[str], run_dir: Path, kill_at: int | None = None) -> float | None:
    """A torchrun job of one worker per host with ``overrides``, until it ends; with ``kill_at``,
    host ``count - 1`` is SIGKILLed once the metrics reach that step (the job has ``--nnodes``
    down to ``count - 1``): the seconds from the kill to the survivors' first metrics line."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    config = run_dir.parent / f"{run_dir.name}.yaml"
    config.write_text(config_mod.to_yaml(config_mod.load(None, overrides)))
    n = hosts.count
    nnodes = str(n) if kill_at is None else f"{n - 1}:{n}"
    agents = []
    for i in range(n):
        command, env = hosts.torchrun(i, nnodes, RDZV_CONF)
        env["PYTHONPATH"] = str(ROOT / "src")
        log = (run_dir.parent / f"{run_dir.name}-agent-{i}.log").open("wb")
        agents.append(subprocess.Popen([*command, "-m", "fedweave.data_parallel", str(config), "--run-dir", str(run_dir)],
                                       env=env, stdout=log, stderr=subprocess.STDOUT))
    recovery = None
    try:
        if kill_at is not None:
            while not (lines := whole_lines(run_dir)) or lines[-1]["step"] < kill_at:
                time.sleep(0.005)
            hosts.kill(n - 1)
            killed = time.monotonic()
            while whole_lines(run_dir)[-1]["generation"] == 0:
                time.sleep(0.005)
            recovery = time.monotonic() - killed
        for a in agents[: n - 1 if kill_at is not None else n]:
            if a.wait(timeout=900) != 0:
                raise SystemExit(f"a torchrun agent failed: see {run_dir.parent}/*-agent-*.log")
    finally:
        for a in agents:
            a.kill()
    return recovery


def whole_lines(run_dir: Path) -> list[dict[str, Any]]:
    """The metrics lines written so far (not one being written)."""
    path = run_dir / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines() if line.endswith("}")]


def in_place_recovery(overrides: list[str], run_dir: Path, kill_at: int) -> float:
    """The seconds from a SIGKILL of worker 2 of one host's launcher to the survivors' first metrics line."""
    config = config_mod.load(None, overrides)
    pids: dict[int, int] = {}
    killed: list[float] = []
    recovered: list[float] = []

    def watch(record: dict[str, Any]) -> None:
        if not killed and record["step"] >= kill_at:
            os.kill(pids[2], signal.SIGKILL)
            killed.append(time.monotonic())
        elif killed and not recovered and record["workers"] == [0, 1]:
            recovered.append(time.monotonic())

    data_parallel.execute(data_parallel.prepare(config, run_dir), on_record=watch, on_start=pids.update)
    return recovered[0] - killed[0]


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
    parser.add_argument("--hosts", type=int, choices=(0, 3), default=0,
                        help="3: each worker on a network namespace of its own under torchrun (root); 0: one host")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved pairs of a dynamic and a static run")
    args = parser.parse_args()
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    logging.basicConfig(level=logging.WARNING)
    B = 224
    hosts = None
    if args.hosts:
        reason = netns.unavailable()
        if reason:
            raise SystemExit(f"--hosts: {reason}")
        hosts = netns.Hosts(args.hosts)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            runs: dict[str, list[list[dict[str, Any]]]] = {"dynamic": [], "static": []}
            for k, policy in interleaved(args.repeats):
                out = Path(tmp) / f"pair-{k}"
                if hosts is None:
                    runs[policy].append(run(policy, args.epochs, args.slowdown, out))
                    continue
                overrides = [*BASE, f"data_parallel.epochs={args.epochs}", f"data_parallel.controller.policy={policy}",
                             f"heterogeneity.slowdown={args.slowdown}"]
                run_hosts(hosts, overrides, out / policy)
                runs[policy].append(read_metrics(out / policy / "metrics.jsonl"))
            if hosts is not None:
                change = [*BASE, "data_parallel.epochs=2", "data_parallel.log_every=1",
                          f"heterogeneity.slowdown={args.slowdown}", "data_parallel.checkpoint_every=10"]
                elastic = run_hosts(hosts, change, Path(tmp) / "kill", kill_at=25)
                in_place = in_place_recovery(change, Path(tmp) / "kill-in-place", kill_at=25)
    finally:
        if hosts is not None:
            hosts.close()
    summaries: dict[str, list[dict[str, Any]]] = {"dynamic": [], "static": []}
    for k, policy in interleaved(args.repeats):
        records = runs[policy][k]
        stats = [epoch_stats(r, B) for r in records]
        steady = stats[1:]
        epoch = statistics.median(s["time"] for s in steady)
        ideal = statistics.median(s["ideal"] for s in steady)
        control = sum(s["controller"] for s in stats) / sum(s["time"] for s in stats)
        one = {"epoch": epoch, "ideal": ideal, "first": stats[0]["time"], "control": control, "records": records,
               "comm": statistics.median(s["comm"] for s in steady)}
        summaries[policy].append(one)
        last = records[-1]
        print(
            f"pair {k} {policy:>7}: epoch {epoch:.2f} s (first epoch {stats[0]['time']:.2f} s), "
            f"final batches {[round(b) for b in last['batch']]}, "
            f"throughput X_i {[round(x) for x in steady[-1]['throughput']]} samples/s, "
            f"comm {one['comm'] * 1000:.1f} ms/step, controller {control:.3%} of wall time"
        )
    bound = ideal_speedup(SPEEDS)
    spread = speedups([s["epoch"] for s in summaries["static"]], [d["epoch"] for d in summaries["dynamic"]], bound)
    middle = sorted(range(args.repeats), key=lambda k: spread["ratios"][k])[(args.repeats - 1) // 2]
    dyn, sta = summaries["dynamic"][middle], summaries["static"][middle]  # the pair of the median speed-up
    print(f"ideal S·(B/ΣX_i + c): {dyn['ideal']:.2f} s per epoch (pair {middle}'s dynamic run: its measured X_i and c)")
    print(f"efficiency (ideal / dynamic epoch):  {dyn['ideal'] / dyn['epoch']:.1%}   target >= 95 %")
    for k, ratio in enumerate(spread["ratios"]):
        flag = f"   INVALID: above the ideal {bound:.2f}x (the host's load changed)" if k in spread["invalid"] else ""
        print(f"speed-up of pair {k} (static / dynamic epoch): {ratio:.2f}x{flag}")
    verdict = f"   INVALID: above the ideal {bound:.2f}x" if spread["median"] > bound else ""
    print(f"speed-up: median {spread['median']:.2f}x, range {spread['low']:.2f}-{spread['high']:.2f}x over "
          f"{args.repeats} interleaved pairs   target >= 2.2x (ideal {bound:.2f}x){verdict}")
    print(f"controller overhead:                 {dyn['control']:.3%}   target <= 2 %")
    for policy, one in (("dynamic", dyn), ("static", sta)):
        records = one["records"]
        accs = " ".join(f"{r['test_accuracy']:.3f}" for r in records)
        print(f"pair {middle} {policy:>7} test accuracy per epoch: {accs}; "
              f"time to {args.target:.2f}: {_fmt(time_to(records, args.target))}")
    t_dyn, t_sta = time_to(dyn["records"], args.target), time_to(sta["records"], args.target)
    if t_dyn and t_sta:
        print(f"time-to-accuracy ratio (static / dynamic): {t_sta / t_dyn:.2f}x; final accuracy "
              f"{dyn['records'][-1]['test_accuracy']:.4f} dynamic vs {sta['records'][-1]['test_accuracy']:.4f} static")
    if hosts is not None:
        print(f"SIGKILL of one host to the survivors' next step: {elastic:.2f} s under torchrun (restart from the "
              f"saved state) vs {in_place:.2f} s in place on one host (the launcher's re-formation)")


def _fmt(seconds: float | None) -> str:
    return "not reached" if seconds is None else f"{seconds:.1f} s"


if __name__ == "__main__":
    main()
