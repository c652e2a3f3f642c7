"""A federated round on ``local.device: cuda`` against the same round on the CPU.

Each row trains one federation twice in this process, once with ``local.device=cpu`` and
once with ``local.device=cuda`` (the clients one after another on the device, and the
server's evaluation there too), from the same seed. Their rounds are interleaved in pairs
(cpu round r, then cuda round r) so that the machine's load falls on both alike; the first
pair (caches, CUDA's start-up, lazy imports) is left out. Printed per row: the median wall
seconds of a round on each device, the median of the per-pair ratios cpu / cuda (the
speed-up) with its interquartile range, the CUDA memory held after each round (its
smallest and largest value: the same when nothing of one client stays on the device for
the next) and the peak, and the largest difference between the two final models.

    python benchmarks/device.py [--rounds 10] [--only mlp cnn ...]

On a machine without CUDA it says so in one line and exits 0. Every client trains every
round, none is sampled, so both devices run the same work. The rows train the clients one
after another (``simulation.cohort: off``) but those named ``-cohort``, which train each round's
clients as one vectorised cohort (``simulation.cohort: auto``, :mod:`fedweave.cohort`) on both
devices; ``benchmarks/cohort.py`` sets the two paths side by side on one device.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from fedweave import config as config_mod
from fedweave import runner
from fedweave.federated.rounds import train_round
from spread import ratio_spread

BASE = [
    "clients=8",
    "sample_fraction=1.0",
    "local={epochs: 1, batch_size: 64, lr: 0.05, momentum: 0.9}",
    "eval.every=1",
    "eval.federated_every=0",
    "checkpoint.every=0",
    "seed=0",
    "simulation.cohort=off",
]

MLP = [  # 0.4 M parameters: matrix products large enough for a GPU to matter
    "task.dataset=synthetic",
    "task.dataset_options={samples: 20000, features: 256, classes: 10}",
    "task.model_options={hidden: [512, 512]}",
]

ROWS: dict[str, list[str]] = {
    "mlp": MLP,
    "cnn": ["task.dataset=mnist5k", "task.model=cnn"],
    "mlp-cohort": [*MLP, "simulation.cohort=auto"],
    "cnn-cohort": ["task.dataset=mnist5k", "task.model=cnn", "simulation.cohort=8"],  # auto: sequential on the cpu
    "digits-100-cohort": ["task.dataset=digits", "clients=100", "simulation.cohort=auto"],
    "mlp-dpsgd": [  # per-example gradients: the work DP-SGD adds
        "task.dataset=synthetic",
        "task.dataset_options={samples: 10000, features: 256, classes: 10}",
        "task.model_options={hidden: [256]}",
        "plugins.client_receive=[{name: dpsgd, noise_multiplier: 1.0, seeded_noise: true}]",
    ],
}


def paired(overrides: list[str], rounds: int, out: Path) -> dict[str, float]:
    """Median wall seconds per round on each device, the per-pair ratios, CUDA memory, final difference."""
    runs = {
        device: runner.prepare(config_mod.load(None, [*BASE, *overrides, f"local.device={device}"]), out / device)
        for device in ("cpu", "cuda")
    }
    params = {device: r.params for device, r in runs.items()}
    seconds: dict[str, list[float]] = {"cpu": [], "cuda": []}
    held: list[float] = []
    torch.cuda.reset_peak_memory_stats()
    for rnd in range(1, rounds + 2):
        for device, r in runs.items():
            started = time.perf_counter()
            params[device], _ = train_round(r.parts, rnd, params[device])
            r.parts.evaluate_global(params[device])
            if device == "cuda":
                torch.cuda.synchronize()
                held.append(torch.cuda.memory_allocated() / 2**20)
            seconds[device].append(time.perf_counter() - started)
    cpu, cuda = seconds["cpu"][1:], seconds["cuda"][1:]
    ratio, q1, q3 = ratio_spread([c / g for c, g in zip(cpu, cuda)])
    return {
        "cpu": statistics.median(cpu),
        "cuda": statistics.median(cuda),
        "ratio": ratio,
        "q1": q1,
        "q3": q3,
        "held_min": min(held[1:]),
        "held_max": max(held[1:]),
        "peak": torch.cuda.max_memory_allocated() / 2**20,
        "diff": max(
            float((params["cpu"][k].double() - params["cuda"][k].double()).abs().max())
            for k in params["cpu"]
            if params["cpu"][k].is_floating_point()
        ),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10, help="measured pairs of rounds (after one left out)")
    parser.add_argument("--only", nargs="*", choices=list(ROWS), help="rows to run (default: all)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/device.py: this machine has no CUDA device, so there is no cuda round to measure")
        return 0
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; {args.rounds} pairs of rounds per row")
    header = f"{'row':<18} {'cpu s':>8} {'cuda s':>8} {'cpu/cuda':>9} {'IQR':>13} {'held MiB':>15} {'peak MiB':>9} {'max |Δ|':>9}"
    print(header)
    with tempfile.TemporaryDirectory() as out:
        for name in args.only or ROWS:
            m = paired(ROWS[name], args.rounds, Path(out) / name)
            print(
                f"{name:<18} {m['cpu']:>8.3f} {m['cuda']:>8.3f} {m['ratio']:>8.2f}x "
                f"{m['q1']:>6.2f}-{m['q3']:<6.2f} {m['held_min']:>7.1f}-{m['held_max']:<7.1f} {m['peak']:>9.1f} {m['diff']:>9.2e}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
