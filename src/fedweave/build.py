"""Build the parts of a run from its config, each on its own.

A simulation builds all of them in one process; a deployment builds the server's
parts in the server process and a client runtime in each client process, from the
same config and seed, so every process derives the same data partition and the
same initial model without exchanging them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedweave.batching.controller import Controller, StaticController
from fedweave.batching.federated import AdaptiveController
from fedweave.client import ClientData, ClientRuntime, ClientSplits, ClientStateStore
from fedweave.config import Config
from fedweave.device import resolve
from fedweave.plugins import PLUGINS
from fedweave.plugins.attacks.poison import Attacker
from fedweave.plugins.chain import POINTS, Chain, Chains
from fedweave.plugins.contracts import check_plugin_class
from fedweave.seeding import derive_seed, numpy_rng
from fedweave.strategies import STRATEGIES
from fedweave.strategies.base import ChecksModel, DeclaresUpdate, StrategyContext
from fedweave.strategies.robust import averager
from fedweave.task import Dataset, build_model, evaluate, load_dataset, make_loss, partition, split_local, summarize
from fedweave.task.datasets import synthetic_means, synthetic_options
from fedweave.task.generated import GeneratedClients
from fedweave.training import LocalSettings, LossFn
from fedweave.types import Params
from fedweave.validation import ExampleLimits, UpdateChecks, UpdateSchema


@dataclass
class TaskBundle:
    """The task of a run: data (split per client), model factory, loss."""

    dataset: Dataset
    clients: ClientSplits
    make_model: Callable[[], torch.nn.Module]
    loss_fn: LossFn
    partition_summary: dict[str, Any]


def build_task(config: Config) -> TaskBundle:
    """Load the dataset and split it across clients, seeded by the run seed."""
    if config.threads:
        torch.set_num_threads(config.threads)
    task = config.task
    dataset = load_dataset(
        task.dataset,
        seed=config.seed,
        test_fraction=task.test_fraction,
        root=task.data_root,
        options=task.dataset_options,
    )

    def make_model() -> torch.nn.Module:
        return build_model(
            task.model, input_shape=dataset.input_shape, num_classes=dataset.num_classes, options=task.model_options
        )

    if task.dataset == "synthetic" and task.dataset_options.get("per_client"):
        generated = generated_clients(config)
        return TaskBundle(dataset, generated, make_model, make_loss(task.loss), generated.summary())
    labels = dataset.y_train.numpy()
    parts = partition(
        labels,
        config.clients,
        task.partition.scheme,
        numpy_rng(config.seed, "partition"),
        alpha=task.partition.alpha,
        shards_per_client=task.partition.shards_per_client,
        min_samples=task.partition.min_samples,
    )
    splits = [
        split_local(p, task.local_test_fraction, numpy_rng(config.seed, "local-split", i))
        for i, p in enumerate(parts)
    ]
    return TaskBundle(
        dataset=dataset,
        clients=ClientData(
            x=dataset.x_train,
            y=dataset.y_train,
            train_idx=[torch.from_numpy(s[0]) for s in splits],
            test_idx=[torch.from_numpy(s[1]) for s in splits],
        ),
        make_model=make_model,
        loss_fn=make_loss(task.loss),
        partition_summary=summarize([s[0] for s in splits], labels, dataset.num_classes),
    )


def generated_clients(config: Config) -> GeneratedClients:
    """The clients of ``synthetic`` with ``per_client``: each generates its data on demand,
    around the class means the run seed gives (the test set's)."""
    task = config.task
    _, features, classes, per_client = synthetic_options(task.dataset_options)
    return GeneratedClients(
        config.seed,
        config.clients,
        per_client,
        synthetic_means(np.random.default_rng(config.seed), features, classes),
        scheme=task.partition.scheme,
        alpha=task.partition.alpha,
        local_test_fraction=task.local_test_fraction,
        min_samples=task.partition.min_samples,
    )


def initial_params(config: Config, task: TaskBundle) -> Params:
    """The seeded initial global model (the same in every process), after the strategy's
    ``check_model`` (if it has one) accepted the model."""
    torch.manual_seed(derive_seed(config.seed, "init"))
    model = task.make_model()
    strategy = strategy_class(config)
    if isinstance(strategy, ChecksModel):  # e.g. MOON needs a representation, FedPer its personal layers
        strategy.check_model(model, config.strategy.params)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def update_checks(config: Config, task: TaskBundle, params: Params) -> UpdateChecks:
    """What the server checks each update against (:mod:`fedweave.validation`): the strategy's
    schema (by default every entry of the model's ``params``), the example limits (in an
    in-memory simulation the server holds every client's data, so it knows each one's
    size), the weight share."""
    cls = strategy_class(config)
    if isinstance(cls, DeclaresUpdate):
        with torch.random.fork_rng(devices=[]):  # a model for its layers; the run's draws are untouched
            schema = cls.update_schema(task.make_model(), config.strategy.params)
    else:
        schema = UpdateSchema.of(params)
    size_of = task.clients.train_size if config.transport.kind == "inmemory" else None
    return UpdateChecks(
        schema=dataclasses.replace(schema, kind=cls.update_kind),
        limits=ExampleLimits(config.aggregation.max_examples, size_of),
        max_weight_share=config.aggregation.max_weight_share,
    )


def build_chains(config: Config) -> Chains:
    """The four plugin chains named in ``config.plugins``, each plugin checked against its
    contracts (:mod:`fedweave.plugins.contracts`), bound to the run (seed, clients)."""
    chains = Chains(
        **{
            point: Chain([PLUGINS.get(s.name, f"plugins.{point}")(s.params) for s in getattr(config.plugins, point)])
            for point in POINTS
        }
    )
    for point in POINTS:
        for i, plugin in enumerate(getattr(chains, point).plugins):
            check_plugin_class(plugin, f"plugins.{point}[{i}]")
    chains.bind(config)
    return chains


def strategy_class(config: Config) -> Any:
    return STRATEGIES.get(config.strategy.name, "strategy.name")


def build_strategy(config: Config) -> Any:
    """The server half of the configured strategy."""
    context = StrategyContext(num_clients=config.clients, seed=config.seed, average=averager(config.aggregation))
    return strategy_class(config)(config.strategy.params, context)


def build_controller(config: Config) -> Controller:
    """The federated controller: ``controller.kind`` static (configured work) or adaptive."""
    work = {
        "batch_size": config.local.batch_size,
        "epochs": config.local.epochs,
        "local_steps": config.local.steps,
        "seed": config.seed,
    }
    if config.controller.kind == "adaptive":
        return AdaptiveController(config.clients, config.clients_per_round, **work, settings=config.controller)
    return StaticController(config.clients, config.clients_per_round, **work)


def build_client_runtime(config: Config, task: TaskBundle, chains: Chains, store: ClientStateStore) -> ClientRuntime:
    """The client side: the strategy's client half over one model instance."""
    return ClientRuntime(
        algorithm=strategy_class(config).Client(config.strategy.params),
        data=task.clients,
        model=task.make_model(),
        loss_fn=task.loss_fn,
        settings=LocalSettings(
            optimizer=config.local.optimizer,
            lr=config.local.lr,
            momentum=config.local.momentum,
            weight_decay=config.local.weight_decay,
        ),
        chains=chains,
        store=store,
        seed=config.seed,
        attacker=build_attacker(config, task),
        device=resolve(config.local.device, "local.device"),
    )


def build_attacker(config: Config, task: TaskBundle) -> Attacker | None:
    """The simulated attack of ``config.attacks`` (None: no attack)."""
    a = config.attacks
    if not a.kinds:
        return None
    return Attacker(a.kinds, a.clients, task.dataset.num_classes, config.seed, a.scale, a.std, a.examples)


def global_evaluator(config: Config, task: TaskBundle) -> Callable[[Params], dict[str, float]]:
    """Evaluate global parameters on the held-out test set (one model instance, reused, on
    ``local.device``; its batches are moved there)."""
    model = task.make_model().to(resolve(config.local.device, "local.device"))

    def evaluate_global(params: Params) -> dict[str, float]:
        model.load_state_dict(params)
        return evaluate(model, task.dataset.x_test, task.dataset.y_test, task.loss_fn, batch_size=config.eval.batch_size)

    return evaluate_global
