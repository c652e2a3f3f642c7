"""Federated LoRA beside full fine-tuning of the same tiny language model.

Workload: examples/lora-stdlib.yaml, set up by examples/lora_stdlib.py in a temporary folder: a
GPT-2-shaped causal LM over bytes (2 layers, 64 wide, 64 positions, pre-trained for 150 steps on the
standard library's LICENSE.txt), six clients each holding one standard-library package's source (json,
http, email, asyncio, urllib, logging), the held-out test text html's; blocks of 64 bytes, 20 local
Adam steps of 16 blocks (lr 0.01) per round, FedAvg. LoRA: rank 8 on c_attn (alpha 16); full
fine-tuning: every weight of the model trains and travels (lr 0.001).

Printed side by side: the uplink bytes of a round (every client's update) and their ratio, the test
perplexity of the base model and after the last round, and the peak memory of a client: the resident
set of a fresh process running a client's local work of one round (its model built, 20 steps),
sampled every 2 ms (its peak, and the peak's growth over the resident set as the round began: the
round's own working memory: gradients, optimiser state, activations).

    python benchmarks/lora.py [--rounds 10]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

from fedweave import config as config_mod
from fedweave import runner
from fedweave.build import build_task, initial_params
from fedweave.task import evaluate
from fedweave.training import LocalOptimizer, LocalSettings

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "lora-stdlib.yaml"
MODES = {"lora": [], "full": ["task.peft.method=null", "task.peft.merged=false", "local.lr=0.001"]}


def overrides(folder: Path, mode: str, rounds: int) -> list[str]:
    return [
        f"task.dataset_options.path={folder}/text/{{client}}", f"task.dataset_options.test_path={folder}/test",
        f"task.model=hf:{folder}/model", f"rounds={rounds}", f"eval.every={rounds}", "task.peft.merged=false",
        *MODES[mode],
    ]


def perplexity_before(config: config_mod.Config) -> float:
    task = build_task(config)
    model = task.make_model()
    model.load_state_dict(initial_params(config, task))
    return evaluate(model, task.dataset.x_test, task.dataset.y_test, task.loss_fn)["perplexity"]


def resident() -> int:
    """This process's resident set, in bytes (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def one_client_round(folder: Path, mode: str) -> None:
    """In this (fresh) process: client 0's local work of a round (its model from the run's initial
    params, ``local.steps`` steps of ``local.batch_size`` blocks with fedweave's local optimiser and
    the task's loss), while a thread samples the resident set; print it (MiB) as the round began and
    at its peak."""
    torch.set_num_threads(1)
    config = config_mod.load(EXAMPLE, overrides(folder, mode, 1))
    task = build_task(config)
    model = task.make_model()
    model.load_state_dict(initial_params(config, task))
    x, y, _, _ = task.clients.split(0)
    local = config.local
    optimizer = LocalOptimizer(model.parameters(), LocalSettings(local.optimizer, local.lr, local.momentum, local.weight_decay))
    generator = torch.Generator().manual_seed(0)
    start = peak = resident()
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.wait(0.002):
            peak = max(peak, resident())

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        for _ in range(local.steps or 1):
            rows = torch.randint(0, len(x), (local.batch_size,), generator=generator)
            optimizer.zero_grad()
            task.loss_fn(model(x[rows]), y[rows]).backward()
            optimizer.step()
    finally:
        done.set()
        sampler.join()
    peak = max(peak, resident())
    print(json.dumps({"start": start / 2**20, "peak": peak / 2**20}))


def client_memory(folder: Path, mode: str) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--client-round", mode, "--folder", str(folder)],
        capture_output=True, text=True, check=True, timeout=600,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--client-round", choices=list(MODES), help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client_round:
        one_client_round(args.folder, args.client_round)
        return
    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT / "examples"))
    import lora_stdlib

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "data"
        lora_stdlib.prepare(folder)
        rows = {}
        for mode in MODES:
            config = config_mod.load(EXAMPLE, overrides(folder, mode, args.rounds))
            before = perplexity_before(config)
            records = runner.execute(runner.prepare(config, Path(tmp) / mode))
            rows[mode] = (records[0]["bytes_received"], before, records[-1]["test_perplexity"], client_memory(folder, mode))
    full = rows["full"][0]
    print(f"{'':>6} {'uplink B/round':>15} {'share':>7} {'ppl before':>11} {'ppl after':>10} {'fall':>6} "
          f"{'client round peak MiB':>22} {'growth MiB':>11}")
    for mode, (up, before, after, memory) in rows.items():
        print(f"{mode:>6} {up:>15,} {up / full:>7.1%} {before:>11.2f} {after:>10.2f} {1 - after / before:>6.1%} "
              f"{memory['peak']:>22.0f} {memory['peak'] - memory['start']:>11.1f}")


if __name__ == "__main__":
    main()
