"""Task kinds: federated regression on diabetes beside a model trained centrally on the same split.

Workload: examples/diabetes-regression.yaml, scikit-learn's 442 diabetes patients (354 training /
88 test, features and target standardised), 5 clients of an iid split, each keeping 20 % of its rows
as its local test split, an MLP with one hidden layer of 32, local SGD (batch 16, lr 0.02, 2 epochs)
and FedAvg over 20 rounds. The central model is the same MLP from the same initial weights, trained
with the same optimiser, batch size and learning rate for as many epochs (rounds x local epochs) on
the union of the clients' training rows; both are scored on the same held-out test set.

Printed per seed: test R2, RMSE and MAE of the federated model after the last round and of the
central one, and the federated mean of the clients' local R2.

    python benchmarks/tasks.py [--rounds 20] [--seeds 0,1,2]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from fedweave import config as config_mod
from fedweave import runner
from fedweave.build import build_task, initial_params
from fedweave.seeding import torch_generator
from fedweave.task import evaluate

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "diabetes-regression.yaml"


def federated(config: config_mod.Config) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as folder:
        records = runner.execute(runner.prepare(config, Path(folder) / "run"))
    return records[-1]


def central(config: config_mod.Config) -> dict[str, float]:
    """The MLP trained on every client's training rows together, scored on the same test set."""
    task = build_task(config)
    rows = torch.cat(task.clients.train_idx)
    x, y = task.clients.x[rows], task.clients.y[rows]
    model = task.make_model()
    model.load_state_dict(initial_params(config, task))
    optimizer = torch.optim.SGD(model.parameters(), lr=config.local.lr)
    generator = torch_generator(config.seed, "central")
    for _ in range(config.rounds * config.local.epochs):
        for batch in torch.randperm(len(rows), generator=generator).split(config.local.batch_size):
            optimizer.zero_grad()
            task.loss_fn(model(x[batch]), y[batch]).backward()
            optimizer.step()
    return {f"test_{k}": v for k, v in evaluate(model, task.dataset.x_test, task.dataset.y_test, task.loss_fn).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--seeds", default="0,1,2")
    args = parser.parse_args()
    print(f"{'seed':>4} {'run':>10} {'R2':>7} {'RMSE':>7} {'MAE':>7} {'local R2':>9}")
    for seed in (int(s) for s in args.seeds.split(",")):
        config = config_mod.load(EXAMPLE, [f"rounds={args.rounds}", f"seed={seed}", f"eval.federated_every={args.rounds}"])
        for name, result in (("federated", federated(config)), ("central", central(config))):
            local = f"{result['federated_r2']:9.3f}" if "federated_r2" in result else f"{'':9}"
            print(f"{seed:>4} {name:>10} {result['test_r2']:7.3f} {result['test_rmse']:7.3f} {result['test_mae']:7.3f} {local}")


if __name__ == "__main__":
    main()
