"""Final test accuracy under attack, for each aggregation rule.

Workload: scikit-learn's digits (1,437 training / 360 test images), 10 clients with an
iid split, every client every round, FedAvg with 2 local epochs of SGD (batch 16,
lr 0.05, momentum 0.9), the MLP of the quickstart. Two of the ten
clients (0 and 1) attack (config ``attacks``, :mod:`fedweave.plugins.attacks.poison`):

- ``none``: no attack, the clean run of each rule;
- ``sign flip x10``: each sends −10 × its update (the headline attack);
- ``scaling x10``: each sends 10 × its update;
- ``noise std 3``: each adds N(0, 9) to every entry of its update;
- ``label flip``: each trains on labels 9 − y;
- ``count inflation``: ONE client (0) trains on flipped labels and claims 1,000,000
  examples: as every in-memory run does, with the server capping the claim at the
  client's true partition size; as a server that knows no sizes (a deployment), with its
  default cohort bound (``aggregation.weight_policy: cap``, 3 x the median claim), with
  ``weight_policy: trust`` (no bound), and with ``aggregation.max_weight_share: 0.2``;
- ``deployed``: the same attacker over gRPC (a server and ten client threads on
  127.0.0.1, the server knowing no size), synchronous and FedBuff (buffer of 5, ten
  clients training at once), each beside its clean run, with the default bound and
  with ``trust``.

Rules: ``mean`` (weighted by examples), ``median``, ``trimmed_mean`` (β = 0.2: two values
dropped at each end of every coordinate), ``krum`` and ``multi_krum`` (f = 2; Multi-Krum
averages the n − f = 8 best). Each cell is the final global model's accuracy on the
held-out test set (mean over seeds) and, in brackets, its difference to the clean run
of the mean.

Encrypted and masked updates (``--secure``, the mean only: these plugins combine updates
while encoded): one client (0) attacks a run with ``he`` or ``secagg``, each row beside the
clean run of its plugin, with the rounds skipped and the clients the plugin refused or excluded:

- ``he: 1 scales x1e9, round 10``: a valid ciphertext of 10^9 times its update, once;
- ``he: 1 scales x1e9, every round``: the same in every round;
- ``he: 1 encrypts under another key``: its ciphertexts made with another federation's keys;
- ``secagg: 1 seals random shares``: random bytes for the shares it seals to its neighbours;
- ``secagg: 1 shifts an unmasking share``: f(x) + 1 for one share it reveals at the unmasking.

    python benchmarks/attacks.py                       # 20 rounds, 1 seed
    python benchmarks/attacks.py --rounds 30 --seeds 2
    python benchmarks/attacks.py --rules mean --attacks "none,gRPC: none,gRPC: 1 inflates (default cap)"
    python benchmarks/attacks.py --secure              # the he and secagg rows
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import platform
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from fedweave import config as config_mod
from fedweave import runner
from fedweave.build import build_chains, build_client_runtime, build_task
from fedweave.federated.client import ClientStateStore
from fedweave.plugins.attacks import poison
from fedweave.plugins.secure import shamir
from fedweave.plugins.secure.he import HE, HEHParams
from fedweave.plugins.secure.secagg.messages import read_shares, share_bytes
from fedweave.types import Control
from fedweave.federated.checks import ExampleLimits

BASE = [
    "task.dataset=digits",
    "task.model=mlp",
    "clients=10",
    "task.partition=iid",
    "local={epochs: 2, batch_size: 16, lr: 0.05, momentum: 0.9}",
    "strategy=fedavg",
    "eval={every: 0, federated_every: 0}",
    "checkpoint.every=0",
    "threads=1",
]

RULES = {
    "mean": ["aggregation.rule=mean"],
    "median": ["aggregation.rule=median"],
    "trimmed_mean": ["aggregation.rule=trimmed_mean", "aggregation.trim_fraction=0.2"],
    "krum": ["aggregation.rule=krum", "aggregation.byzantine=2"],
    "multi_krum": ["aggregation.rule=multi_krum", "aggregation.byzantine=2"],
}

TWO = "attacks.clients=[0, 1]"
INFLATE = ["attacks.kind=[label_flip, inflate_examples]", "attacks.clients=[0]"]
TRUST = "aggregation.weight_policy=trust"
GRPC = ["transport=grpc", "grpc.listen=127.0.0.1:0", "grpc.heartbeat_interval=0.2", "grpc.poll_timeout=0.5",
        "grpc.join_timeout=60"]
FEDBUFF = [*GRPC, "asynchronous.enabled=true", "asynchronous.buffer_size=5"]
ATTACKS = {  # row: (overrides, where: memory | blind (in memory, the server knowing no size) | deployed)
    "none": ([], "memory"),
    "sign flip x10": (["attacks.kind=sign_flip", "attacks.scale=10", TWO], "memory"),
    "scaling x10": (["attacks.kind=scaling", "attacks.scale=10", TWO], "memory"),
    "noise std 3": (["attacks.kind=noise", "attacks.std=3", TWO], "memory"),
    "label flip": (["attacks.kind=label_flip", TWO], "memory"),
    "1 inflates: capped at its size": (INFLATE, "memory"),
    "1 inflates: no size known (default cap)": (INFLATE, "blind"),
    "1 inflates: no size known (trust)": ([*INFLATE, TRUST], "blind"),
    "1 inflates: max_weight_share 0.2": ([*INFLATE, TRUST, "aggregation.max_weight_share=0.2"], "blind"),
    "gRPC: none": (GRPC, "deployed"),
    "gRPC: 1 inflates (default cap)": ([*GRPC, *INFLATE], "deployed"),
    "gRPC: 1 inflates (trust)": ([*GRPC, *INFLATE, TRUST], "deployed"),
    "FedBuff gRPC: none": (FEDBUFF, "deployed"),
    "FedBuff gRPC: 1 inflates (default cap)": ([*FEDBUFF, *INFLATE], "deployed"),
    "FedBuff gRPC: 1 inflates (trust)": ([*FEDBUFF, *INFLATE, TRUST], "deployed"),
}


def accuracy(overrides: list[str], where: str) -> float:
    """The final test accuracy of one run, in memory, in memory with the server knowing no
    client's partition size (``blind``), or ``deployed`` over gRPC to client threads."""
    with tempfile.TemporaryDirectory() as out:
        config = config_mod.load(None, [*BASE, *overrides, f"output_dir={out}"])
        if where == "deployed":
            return deployed_accuracy(config)
        run = runner.prepare(config)
        if where == "blind":
            run.parts.checks = dataclasses.replace(run.parts.checks, limits=ExampleLimits(config.aggregation.max_examples))
        records = runner.run_rounds(run)
    return float(records[-1]["test_accuracy"])


def deployed_accuracy(config: config_mod.Config) -> float:
    """The final test accuracy of a run served over gRPC on 127.0.0.1 to a thread per client."""
    from fedweave.reach import server_topology
    from fedweave.transports.grpc.client import GrpcClient

    run = runner.prepare(config, topology=server_topology(config))
    task = build_task(config)
    address = run.parts.topology.transport.address
    nodes = [
        GrpcClient(config.grpc, cid, build_client_runtime(config, task, build_chains(config), ClientStateStore()).handle,
                   address=address)
        for cid in range(config.clients)
    ]
    threads = [threading.Thread(target=node.run, daemon=True) for node in nodes]
    for thread in threads:
        thread.start()
    try:
        records = runner.run_rounds(run)
    finally:
        for node in nodes:
            node.stop()
        for thread in threads:
            thread.join(timeout=10)
    return float(records[-1]["test_accuracy"])
HE_CHAIN = "plugins.client_send=[{name: he}]"
SECAGG_CHAIN = "plugins.client_send=[{name: secagg}]"
SCALE = ["attacks.kind=scaling", "attacks.scale=1e9", "attacks.clients=[0]"]


Undo = Callable[[], None]


def _in_round(rnd: int) -> Callable[[Any], Undo]:
    """Client 0's ``attacks`` in round ``rnd`` only (the attacker attacks every round)."""
    def tamper(run: Any) -> Undo:
        honest = poison.Attacker.update
        poison.Attacker.update = lambda self, u, params, at, cid: honest(self, u, params, at, cid) if at == rnd else u
        return lambda: setattr(poison.Attacker, "update", honest)
    return tamper


def _other_key(run: Any) -> Undo:
    """Client 0 encrypts its updates under another federation's keys."""
    plugin, other = run.parts.chains.client_send.plugins[0], HE(HEHParams())
    honest = plugin.encode
    plugin.encode = lambda payload, ctx: other.encode(payload, ctx) if ctx.client_id == 0 else honest(payload, ctx)
    return lambda: setattr(plugin, "encode", honest)


def _answering(change: Callable[[Control, Any], Control]) -> Callable[[Any], Undo]:
    """Client 0 answers secagg's control steps through ``change``."""
    def tamper(run: Any) -> Undo:
        plugin = run.parts.chains.client_send.plugins[0]
        honest = plugin.answer
        plugin.answer = lambda control, ctx: change(honest(control, ctx), ctx) if ctx.client_id == 0 else honest(control, ctx)
        return lambda: setattr(plugin, "answer", honest)
    return tamper


def _random_shares(answer: Control, ctx: Any) -> Control:
    if answer.step != "share":
        return answer
    noise = torch.randint(0, 256, answer.tensors["shares"].shape, dtype=torch.uint8)
    return Control(answer.plugin, answer.step, {**answer.tensors, "shares": noise})


def _shifted_share(answer: Control, ctx: Any) -> Control:
    if answer.step != "unmask" or not len(answer.tensors["seed"]):
        return answer
    rows = answer.tensors["seed"].clone()
    ((value, blinding),) = read_shares(bytes(rows[-1].numpy()))
    rows[-1] = torch.frombuffer(bytearray(share_bytes([((value + 1) % shamir.PRIME, blinding)])), dtype=torch.uint8)
    return Control(answer.plugin, answer.step, {**answer.tensors, "seed": rows})


SECURE = {  # row: (overrides, what client 0 does to the run)
    "he: none": ([HE_CHAIN], None),
    "he: 1 scales x1e9, round 10": ([HE_CHAIN, *SCALE], _in_round(10)),
    "he: 1 scales x1e9, every round": ([HE_CHAIN, *SCALE], None),
    "he: 1 encrypts under another key": ([HE_CHAIN], _other_key),
    "secagg: none": ([SECAGG_CHAIN], None),
    "secagg: 1 seals random shares": ([SECAGG_CHAIN], _answering(_random_shares)),
    "secagg: 1 shifts an unmasking share": ([SECAGG_CHAIN], _answering(_shifted_share)),
}


def secure_run(overrides: list[str], tamper: Callable[[Any], Undo] | None) -> tuple[float, int, float]:
    """One run with he or secagg: its clients' final federated test accuracy (the server of an he run
    holds no plaintext model), the rounds skipped, and the clients the plugin refused or excluded."""
    with tempfile.TemporaryDirectory() as out:
        config = config_mod.load(None, [*BASE, *overrides, "eval={every: 0, federated_every: 1000}",
                                        f"output_dir={out}"])
        run = runner.prepare(config)
        undo = tamper(run) if tamper is not None else None
        try:
            records = runner.run_rounds(run)
        finally:
            if undo is not None:
                undo()
    counted = sum(r.get("he_refused", 0) + r.get("secagg_excluded", 0) for r in records)
    return float(records[-1]["federated_accuracy"]), sum(bool(r["skipped"]) for r in records), counted


def main_secure(rounds: int, seeds: int) -> None:
    logging.getLogger("fedweave").setLevel(logging.CRITICAL)  # each skipped round is logged; the table counts them
    started = time.perf_counter()
    rows = {}
    for row, (overrides, tamper) in SECURE.items():
        runs = [secure_run([*overrides, f"rounds={rounds}", f"seed={seed}"], tamper) for seed in range(seeds)]
        rows[row] = tuple(statistics.mean(r[i] for r in runs) for i in range(3))
    width = max(len(r) for r in rows)
    print(f"digits, 10 clients (iid), FedAvg (mean), {rounds} rounds, {seeds} seed(s); final federated test "
          f"accuracy, in brackets minus the plugin's clean run's ({platform.machine()}, "
          f"{time.perf_counter() - started:.0f} s)")
    print(f"{'attack':<{width}}  {'accuracy':>16}  {'skipped':>7}  {'refused or excluded':>19}")
    for row, (value, skipped, counted) in rows.items():
        clean = rows[row.split(":")[0] + ": none"][0]
        print(f"{row:<{width}}  {f'{value:.3f} ({value - clean:+.3f})':>16}  {skipped:>7.0f}  {counted:>19.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--rules", default=",".join(RULES), help="comma-separated subset of " + ", ".join(RULES))
    parser.add_argument("--attacks", default=",".join(ATTACKS), help="comma-separated subset of the rows")
    parser.add_argument("--secure", action="store_true", help="the he and secagg rows instead (the mean only)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)
    if args.secure:
        main_secure(args.rounds, args.seeds)
        return
    rules = args.rules.split(",")
    rows = args.attacks.split(",")
    started = time.perf_counter()
    table: dict[str, dict[str, float]] = {}
    for row in rows:
        overrides, where = ATTACKS[row]
        table[row] = {}
        for rule in rules:
            runs = [
                accuracy([*overrides, *RULES[rule], f"rounds={args.rounds}", f"seed={seed}"], where)
                for seed in range(args.seeds)
            ]
            table[row][rule] = statistics.mean(runs)
    width = max(len(r) for r in rows)
    print(f"digits, 10 clients (iid), FedAvg, {args.rounds} rounds, {args.seeds} seed(s); "
          f"final test accuracy; in brackets: minus the clean mean's ({platform.machine()}, "
          f"{time.perf_counter() - started:.0f} s)")
    print(f"{'attack':<{width}}  " + "  ".join(f"{rule:>16}" for rule in rules))
    clean = table.get("none", {}).get("mean")
    for row in rows:
        cells = []
        for rule in rules:
            value = table[row][rule]
            gap = f" ({value - clean:+.3f})" if clean is not None else ""
            cells.append(f"{value:.3f}{gap}".rjust(16))
        print(f"{row:<{width}}  " + "  ".join(cells))


if __name__ == "__main__":
    main()
