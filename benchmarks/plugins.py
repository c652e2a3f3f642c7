"""What privacy and compression plugins cost and buy, on MNIST-5k.

Every configuration trains the same federation (MNIST-5k, an MLP 784-128-10 of 101,770
parameters, Dirichlet(0.5) label skew, one local epoch of SGD with momentum, the same
seed) for the same number of rounds, and is compared with the run without plugins of
the same federation size:

- final test accuracy, and its difference to the dense run;
- uplink bytes (client → server, ``bytes_received``) and downlink bytes (server →
  client, ``bytes_sent``) over the run, as the factor dense / plugin;
- median seconds per round, as the factor plugin / dense;
- for differential privacy, ε at δ = 1e-5 after the last round.

    python benchmarks/plugins.py [--rounds 40] [--clients 20] [--only topk-1%+EF int8 ...]

Secure aggregation is also timed with 100 clients (SecAgg+ with 14, 8 and 6 neighbours;
with one local epoch, about 2 SGD steps per client, and with FedAvg's E = 5, B = 10)
against plaintext FedAvg with the same 100 clients and local work, and HE with 10 clients. The machine's load moves the
timings; accuracies and bytes are exact for the seed. For the configurations in
``PAIRED`` a second measurement follows the table, steadier under load: the plugin's
rounds and the dense rounds interleaved in one process, CPU and wall seconds of each round,
and the medians of the per-round ratios, the CPU one with its interquartile range
(``--paired-rounds``, 0 to skip): the codecs
(top-k 1 %, random-k 10 %, QSGD-8, int8, with the table's federation) and SecAgg+. Its last
column, for SecAgg+, is the floor no SecAgg+ implementation goes under on this machine: the dense round plus
the cryptography alone (per client a key pair, k X25519 agreements and k + 1 AES-CTR
masks of the model added in place), as a factor of the dense round.

``--deployment R`` adds the cost as a deployment sees it: the server and each of the
100 clients as its own process over gRPC on this machine (``launcher: process``), so
clients work in parallel as far as the cores allow and every message is serialized and
sent. It runs the dense federation, each configuration of ``DEPLOYED``, then the dense
one again, ``R`` rounds each, and prints the median wall seconds per round (the first
round, with its connections and imports, left out) against the dense median of both
dense runs. About 300 MB of memory per process.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedweave import config as config_mod
from fedweave import runner
from fedweave.federated.rounds import train_round
from fedweave.build import build_task, global_evaluator

BASE = [
    "task.dataset=mnist5k",
    "task.model=mlp",
    "task.model_options={hidden: [128]}",
    "task.partition={scheme: dirichlet, alpha: 0.5}",
    "local={epochs: 1, batch_size: 32, lr: 0.05, momentum: 0.9}",
    "eval.every=0",
    "eval.federated_every=0",
    "checkpoint.every=0",
    "threads=1",
    "seed=0",
]


def send(*plugins: str) -> str:
    return f"plugins.client_send=[{', '.join(plugins)}]"


def broadcast(*plugins: str) -> str:
    return f"plugins.server_send=[{', '.join(plugins)}]"


LOCAL_E5B10 = ["local.epochs=5", "local.batch_size=10"]

# name -> (federation overrides, plugin overrides); the baseline of a row is the run
# with the same federation overrides and no plugins.
CONFIGS: dict[str, tuple[list[str], list[str]]] = {
    "topk-1%+EF": ([], [send("{name: topk, ratio: 0.01}")]),
    "topk-1%+EF-fp16": ([], [send("{name: topk, ratio: 0.01, values: float16}")]),
    "randk-10%": ([], [send("{name: randk, ratio: 0.1}")]),
    "qsgd-8bit": ([], [send("{name: qsgd, levels: 127}")]),
    "qsgd-4bit": ([], [send("{name: qsgd, levels: 7}")]),
    "int8": ([], [send("{name: quantize, dtype: int8}")]),
    "fp16": ([], [send("{name: quantize, dtype: float16}")]),
    "bf16": ([], [send("{name: quantize, dtype: bfloat16}")]),
    "powersgd-r4+EF": ([], [send("{name: powersgd, rank: 4}")]),
    "both-int8": ([], [send("{name: quantize, dtype: int8}"), broadcast("{name: quantize, dtype: int8}")]),
    "both-topk": ([], [send("{name: topk, ratio: 0.01}"), broadcast("{name: topk, ratio: 0.1}")]),
    "dp-central-z1": (["clients=100"], [send("{name: dp_central, clip: 0.5, noise_multiplier: 1.0, seeded_noise: true}")]),
    "dp-central-z3": (["clients=100"], [send("{name: dp_central, clip: 0.5, noise_multiplier: 3.0, seeded_noise: true}")]),
    "dp-central-z3-adaptive": (
        ["clients=100"],
        [send("{name: dp_central, clip: 0.5, noise_multiplier: 3.0, adaptive: true, count_noise: 5.0, seeded_noise: true}")],
    ),
    "dp-local-z0.05": (["clients=100"], [send("{name: dp_local, clip: 0.5, noise_multiplier: 0.05, seeded_noise: true}")]),
    "dpsgd-z1": ([], ["plugins.client_receive=[{name: dpsgd, noise_multiplier: 1.0, max_grad_norm: 1.0, seeded_noise: true}]"]),
    "secagg": ([], [send("{name: secagg}")]),
    "secagg+100": (["clients=100"], [send("{name: secagg, neighbours: 14}")]),
    "secagg+100-k6": (["clients=100"], [send("{name: secagg, neighbours: 6}")]),
    "secagg+100-k8": (["clients=100"], [send("{name: secagg, neighbours: 8}")]),
    # the local work of McMahan et al.'s FedAvg (E = 5 epochs, B = 10) rather than 2 steps
    "secagg+100-E5B10": (["clients=100", *LOCAL_E5B10], [send("{name: secagg, neighbours: 14}")]),
    "secagg+100-k8-E5B10": (["clients=100", *LOCAL_E5B10], [send("{name: secagg, neighbours: 8}")]),
    "he-10": (["clients=10"], [send("{name: he}")]),
}


PAIRED = (
    "topk-1%+EF", "randk-10%", "qsgd-8bit", "int8",
    "secagg+100", "secagg+100-k6", "secagg+100-k8", "secagg+100-E5B10", "secagg+100-k8-E5B10",
)
DEPLOYED = ("secagg+100", "secagg+100-k8")
GRPC = ["transport=grpc", "launcher=process", "round_timeout=600"]


def paired_cost(federation: list[str], plugins: list[str], rounds: int, out: Path) -> dict[str, float]:
    """Median CPU and wall seconds per round of the dense run and of the plugin run, their
    rounds interleaved so that the machine's load falls on both alike, and the medians of
    the per-round ratios. The first round (caches, lazy imports) is left out. With secure
    aggregation, after each pair of rounds, the cryptography alone of a SecAgg+ round
    (:func:`crypto_floor`), as ``floor_ratio``: 1 + its CPU seconds over the dense round's
    (NaN for other plugins)."""
    runs = [runner.prepare(config_mod.load(None, [*BASE, *federation, *extra]), out / f"paired{i}") for i, extra in enumerate(([], plugins))]
    params = [r.params for r in runs]
    cpu: list[list[float]] = [[], []]
    wall: list[list[float]] = [[], []]
    floor: list[float] = []
    for rnd in range(1, rounds + 2):
        for i, r in enumerate(runs):
            started, started_wall = time.process_time(), time.perf_counter()
            params[i], _ = train_round(r.parts, rnd, params[i])
            cpu[i].append(time.process_time() - started)
            wall[i].append(time.perf_counter() - started_wall)
        if rnd > 1 and runs[1].parts.chains.client_send.combiner is not None:
            floor.append(crypto_floor(runs[1]))
    out_: dict[str, float] = {}
    for what, seconds in (("cpu", cpu), ("wall", wall)):
        dense, plugin = seconds[0][1:], seconds[1][1:]
        out_[f"dense_{what}"] = statistics.median(dense)
        out_[f"plugin_{what}"] = statistics.median(plugin)
        ratios = [p / d for d, p in zip(dense, plugin)]
        out_[f"{what}_ratio"] = statistics.median(ratios)
        if what == "cpu":  # its interquartile range, printed beside it
            out_["cpu_q1"], _, out_["cpu_q3"] = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    out_["floor_ratio"] = statistics.median(1 + f / d for d, f in zip(cpu[0][1:], floor)) if floor else float("nan")
    return out_


def crypto_floor(r: runner.Run) -> float:
    """CPU seconds of the cryptography one SecAgg+ round cannot do without: for each client a
    key pair, k X25519 agreements and k + 1 AES-CTR masks of the model added in place (the
    pairwise ones and the self mask), with the plugin's own PRG. No message, no Shamir, no
    quantization, no server."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    plugin = r.parts.chains.client_send.combiner
    n = r.config.clients
    k = len(plugin.graph(1, list(range(n)))[0])  # the ring's degree, as the plugin builds it
    size = sum(t.numel() for t in r.params.values() if t.is_floating_point())
    acc = np.zeros(size, dtype=plugin.field.dtype)
    peers = [X25519PrivateKey.generate().public_key() for _ in range(k)]
    seeds = [os.urandom(16) for _ in range(k + 1)]
    started = time.process_time()
    with plugin.field.workspace(size) as (stream, _):
        for _ in range(n):
            key = X25519PrivateKey.generate()
            key.public_key().public_bytes_raw()
            for peer in peers:
                key.exchange(peer)
            for seed in seeds:
                plugin.field.add_mask(acc, seed, stream)
    return time.process_time() - started


def run(overrides: list[str], out: Path) -> dict[str, Any]:
    config = config_mod.load(None, [*BASE, *overrides])
    r = runner.prepare(config, out)
    started = time.perf_counter()
    records = runner.execute(r)
    accuracy = records[-1]["test_accuracy"]
    if accuracy is None:  # the server kept the model encrypted (he): the simulation's clients decrypted r.params
        accuracy = global_evaluator(config, build_task(config))(r.params)["accuracy"]
    return {
        "accuracy": accuracy,
        "uplink": sum(x["bytes_received"] for x in records),
        "downlink": sum(x["bytes_sent"] for x in records),
        "round_s": statistics.median(x["wall_time"] for x in records[:-1] or records),
        "epsilon": records[-1].get("epsilon"),
        "total_s": time.perf_counter() - started,
        "skipped": sum(bool(x["skipped"]) for x in records),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--only", nargs="*", choices=sorted(CONFIGS), help="run these configurations only")
    parser.add_argument("--paired-rounds", type=int, default=10, help="paired rounds per PAIRED configuration")
    parser.add_argument("--deployment", type=int, default=0, metavar="R", help="rounds of the gRPC deployment runs (0: none)")
    args = parser.parse_args()
    if args.deployment == 1 or args.deployment < 0:
        parser.error("--deployment needs at least 2 rounds (the first is left out), or 0")
    torch.set_num_threads(1)
    names = args.only or list(CONFIGS)
    baselines: dict[tuple[str, ...], dict[str, Any]] = {}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(names):
            federation, plugins = CONFIGS[name]
            if not any(o.startswith("clients=") for o in federation):
                federation = [f"clients={args.clients}", *federation]
            federation = [f"rounds={args.rounds}", *federation]
            key = tuple(federation)
            if key not in baselines:
                baselines[key] = run(federation, Path(tmp) / f"dense{len(baselines)}")
                rows.append(("dense " + " ".join(federation[1:]), baselines[key], baselines[key]))
                print_row(*rows[-1], header=len(rows) == 1)
            rows.append((name, run([*federation, *plugins], Path(tmp) / f"run{i}"), baselines[key]))
            print_row(*rows[-1])
        paired = [n for n in names if n in PAIRED] if args.paired_rounds > 0 else []
        if paired:
            print(
                f"\n| paired rounds ({args.paired_rounds}) | dense CPU s / round | plugin CPU s / round | CPU × | its IQR "
                "| dense wall s / round | plugin wall s / round | wall × | crypto floor × |"
            )
            print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for name in paired:
            federation, plugins = CONFIGS[name]
            if not any(o.startswith("clients=") for o in federation):
                federation = [f"clients={args.clients}", *federation]
            c = paired_cost(federation, plugins, args.paired_rounds, Path(tmp) / name)
            floor = "-" if math.isnan(c["floor_ratio"]) else f"{c['floor_ratio']:.2f}"
            print(
                f"| {name} | {c['dense_cpu']:.3f} | {c['plugin_cpu']:.3f} | {c['cpu_ratio']:.2f} | {c['cpu_q1']:.2f}–{c['cpu_q3']:.2f} "
                f"| {c['dense_wall']:.3f} | {c['plugin_wall']:.3f} | {c['wall_ratio']:.2f} | {floor} |",
                flush=True,
            )
        deployed = [n for n in names if n in DEPLOYED]
        if args.deployment > 0 and deployed:
            deployment(args.deployment, deployed, Path(tmp))


def deployment(rounds: int, names: list[str], out: Path) -> None:
    """Median wall seconds per round over gRPC with every node a process (first round left
    out), each configuration against the dense runs before and after it."""
    def seconds(overrides: list[str], where: str) -> list[float]:
        config = config_mod.load(None, [*BASE, f"rounds={rounds}", *GRPC, *overrides])
        return [x["wall_time"] for x in runner.execute(runner.prepare(config, out / where))][1:]

    federation = CONFIGS[names[0]][0]
    dense = seconds(federation, "deployed-dense0")
    plugin = {name: seconds([*CONFIGS[name][0], *CONFIGS[name][1]], f"deployed-{name}") for name in names}
    dense += seconds(federation, "deployed-dense1")
    base = statistics.median(dense)
    print(f"\n| gRPC, every node a process ({rounds} rounds) | s / round | × dense |")
    print("| --- | ---: | ---: |")
    print(f"| dense {' '.join(federation)} (runs before and after) | {base:.3f} | 1.00 |")
    for name, values in plugin.items():
        print(f"| {name} | {statistics.median(values):.3f} | {statistics.median(values) / base:.2f} |", flush=True)


def print_row(name: str, r: dict[str, Any], base: dict[str, Any], header: bool = False) -> None:
    if header:
        print("| configuration | accuracy | Δ vs dense | uplink MB | uplink ÷ | downlink ÷ | s / round | time × | ε |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    eps = "-" if r["epsilon"] is None else f"{r['epsilon']:.2f}"
    skipped = f" ({r['skipped']} skipped)" if r["skipped"] else ""
    print(
        f"| {name}{skipped} | {r['accuracy']:.4f} | {100 * (r['accuracy'] - base['accuracy']):+.2f} pt | "
        f"{r['uplink'] / 1e6:.2f} | {base['uplink'] / r['uplink']:.1f}x | {base['downlink'] / r['downlink']:.2f}x | "
        f"{r['round_s']:.3f} | {r['round_s'] / base['round_s']:.2f} | {eps} |",
        flush=True,
    )


if __name__ == "__main__":
    main()
