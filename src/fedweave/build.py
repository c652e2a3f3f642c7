"""Build the parts of a run from its config, each on its own.

A simulation builds all of them in one process; a deployment builds the server's
parts in the server process and a client runtime in each client process, from the
same config and seed, so every process derives the same data partition and the
same initial model without exchanging them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedweave.federated.controller import Controller, StaticController
from fedweave.federated.adaptive import AdaptiveController
from fedweave.federated.selection import build_selection
from fedweave.federated.client import ClientData, ClientRuntime, ClientSplits, ClientStateStore
from fedweave.config import Config
from fedweave.config.sections import HF_MODEL
from fedweave.deadlines import Deadlines
from fedweave.device import resolve
from fedweave.errors import ConfigError
from fedweave.plugins import PLUGINS
from fedweave.plugins.attacks.poison import Attacker
from fedweave.plugins.chain import Chain, Chains
from fedweave.plugins.contracts import POINTS, check_plugin_class
from fedweave.seeding import TORCH_GLOBAL, derive_seed, numpy_rng
from fedweave.strategies import STRATEGIES
from fedweave.strategies.base import ChecksModel, DeclaresUpdate, StrategyContext
from fedweave.strategies.robust import averager
from fedweave.task import Dataset, build_model, evaluate, load_dataset, make_loss, partition, split_local, summarize
from fedweave.task.assignment import read_assignment
from fedweave.task.datasets import synthetic_means, synthetic_options
from fedweave.task.files import FileData, SiteData, load_files, simulation_paths
from fedweave.task.generated import GeneratedClients
from fedweave.task.partition import natural
from fedweave.task.schema import DataSchema
from fedweave.task.tokenize import Blocks
from fedweave.training import LocalSettings, LossFn
from fedweave.types import Params
from fedweave.federated.checks import ExampleLimits, UpdateChecks, UpdateSchema, WeightPolicy

logger = logging.getLogger(__name__)


@dataclass
class TaskBundle:
    """The task of a run: data (split per client), model factory, loss."""

    dataset: Dataset
    clients: ClientSplits
    make_model: Callable[[], torch.nn.Module]
    loss_fn: LossFn
    partition_summary: dict[str, Any]
    schema: DataSchema | None = None
    """What each site's data must look like (``task.dataset: files``); None for the other datasets."""


def use_threads(config: Config) -> None:
    """torch's intra-op threads of this process: ``threads`` (0: torch's default)."""
    if config.threads:
        torch.set_num_threads(config.threads)


def data_seed(config: Config) -> int:
    """The seed of the data split (holdout, partition, local test splits): ``task.partition.seed``,
    else the run's ``seed``, so a fixed partition can be trained under several seeds."""
    seed = config.task.partition.seed
    return config.seed if seed is None else seed


def sites_read_own_data(config: Config) -> bool:
    """Whether each client reads only its own files (``task.dataset: files`` with a ``{client}``
    path, or with none: each deployed client gives its own ``--data``)."""
    return config.task.dataset == "files" and config.task.file_options().per_site


def data_admission(config: Config) -> Callable[[Any], str | None] | None:
    """What a gRPC server of ``config`` asks of a registering client's declared data schema: the
    reason to refuse it (:meth:`~fedweave.task.schema.DataSchema.refusal`), where the sites read
    their own data; None (nothing asked) otherwise."""
    if not sites_read_own_data(config):
        return None
    return load_files(config.task.file_options(), [], deployed=True, kind=config.task.kind, text=blocks_of(config)).schema.refusal


def build_task(config: Config) -> TaskBundle:
    """Load the dataset and split it across clients, seeded by :func:`data_seed`; a gRPC server
    whose sites read their own data reads none (:func:`build_server_task`)."""
    if config.transport.kind == "grpc" and sites_read_own_data(config):
        return build_server_task(config)
    use_threads(config)
    task = config.task
    seed = data_seed(config)
    files = None
    if task.dataset == "files":
        options = task.file_options()
        files = load_files(
            options,
            simulation_paths(options, config.clients),
            by=task.partition.by,
            natural=task.partition.scheme == "natural",
            kind=task.kind,
            text=blocks_of(config),
        )
        dataset = files.dataset
    else:
        dataset = load_dataset(
            task.dataset, seed=seed, test_fraction=task.test_fraction, root=task.data_root,
            options=task.dataset_options, kind=task.kind,
        )
    make_model = _model_factory(config, dataset)
    if task.dataset == "synthetic" and task.dataset_options.get("per_client"):
        generated = generated_clients(config)
        loss = make_loss(task.loss, task.kind, task.metrics)
        return TaskBundle(dataset, generated, make_model, loss, generated.summary())
    classes = task.kind == "classification"
    labels = dataset.y_train.numpy() if classes else np.zeros(len(dataset.y_train), dtype=np.int64)
    parts = client_parts(config, labels, files)
    splits = [
        split_local(p, task.local_test_fraction, numpy_rng(seed, "local-split", i)) for i, p in enumerate(parts)
    ]
    shares_labels = classes and (files is None or task.file_options().share_label_counts)
    return TaskBundle(
        dataset=dataset,
        clients=ClientData(
            x=dataset.x_train,
            y=dataset.y_train,
            train_idx=[torch.from_numpy(s[0]) for s in splits],
            test_idx=[torch.from_numpy(s[1]) for s in splits],
        ),
        make_model=make_model,
        loss_fn=make_loss(task.loss, task.kind, task.metrics),
        partition_summary=summarize([s[0] for s in splits], labels, dataset.num_classes, label_counts=shares_labels),
        schema=None if files is None else files.schema,
    )


def build_site_task(config: Config, client_id: int, data: str | None = None) -> TaskBundle:
    """The task of deployed client ``client_id`` reading only its own file: ``data`` (its ``--data``),
    else its file of the ``{client}`` template. Its rows and local test split are those the
    simulation of the same files gives it; the file is checked against the federation's schema."""
    use_threads(config)
    task = config.task
    options = task.file_options()
    path = data if data is not None else options.path_of(client_id) if options.template else None
    if path is None:
        raise ConfigError(
            f"task.dataset_options.path: client {client_id} reads only its own data: give --data PATH, or a path "
            "with {client}"
        )
    files = load_files(options, [path], test=False, deployed=True, kind=task.kind, text=blocks_of(config))
    dataset, rows = files.dataset, np.arange(len(files.dataset.y_train), dtype=np.int64)
    if len(rows) < task.partition.min_samples:
        raise ConfigError(f"task.partition.min_samples: {path} has {len(rows)} rows, fewer than {task.partition.min_samples}")
    train, test = split_local(rows, task.local_test_fraction, numpy_rng(data_seed(config), "local-split", client_id))
    shares_labels = options.share_label_counts and task.kind == "classification"
    summary = summarize([train], dataset.y_train.numpy(), dataset.num_classes, label_counts=shares_labels)
    return TaskBundle(
        dataset=dataset,
        clients=SiteData(client_id, config.clients, dataset, train, test),
        make_model=_model_factory(config, dataset),
        loss_fn=make_loss(task.loss, task.kind, task.metrics),
        partition_summary=summary,
        schema=files.schema,
    )


def build_server_task(config: Config) -> TaskBundle:
    """The task of a server whose clients read their own data: the model, the loss and the central
    test set (``test_path``) or none; no training row and no client's size."""
    use_threads(config)
    task = config.task
    files = load_files(task.file_options(), [], deployed=True, kind=task.kind, text=blocks_of(config))
    return TaskBundle(
        dataset=files.dataset,
        clients=ClientData(files.dataset.x_train, files.dataset.y_train, [], []),
        make_model=_model_factory(config, files.dataset),
        loss_fn=make_loss(task.loss, task.kind, task.metrics),
        partition_summary={"clients": config.clients, "own_data": True},
        schema=files.schema,
    )


def blocks_of(config: Config) -> Blocks:
    """How a language model's text becomes token blocks: ``task.tokenizer`` and ``task.sequence_length``."""
    return Blocks(config.task.tokenizer, config.task.sequence_length)


def _model_factory(config: Config, dataset: Dataset) -> Callable[[], torch.nn.Module]:
    task = config.task
    if task.model.startswith(HF_MODEL):
        from fedweave.task.hf import check_fits
        from fedweave.task.lora import language_model

        with TORCH_GLOBAL, torch.random.fork_rng(devices=[]):  # the adapters' draws; the run's are untouched
            check_fits(language_model(task), dataset.num_classes, task.sequence_length, task.model)

        def make_language_model() -> torch.nn.Module:
            with TORCH_GLOBAL:  # its draws are never another thread's seeded ones (initial_params)
                return language_model(task)

        return make_language_model

    def make_model() -> torch.nn.Module:  # build_model draws under seeding.TORCH_GLOBAL itself
        return build_model(
            task.model, input_shape=dataset.input_shape, num_classes=dataset.num_classes, options=task.model_options
        )

    return make_model


def client_parts(config: Config, labels: np.ndarray, files: FileData | None) -> list[np.ndarray]:
    """Each client's rows of the training set: its own file's, the natural split's, the file map's,
    or the partition scheme's draw."""
    p = config.task.partition
    if files is not None and files.parts is not None:
        small = next((c for c, part in enumerate(files.parts) if len(part) < p.min_samples), None)
        if small is not None:
            raise ConfigError(
                f"task.partition.min_samples: {config.task.file_options().path_of(small)} has "
                f"{len(files.parts[small])} rows, fewer than {p.min_samples}"
            )
        return files.parts
    if p.scheme == "natural":
        assert files is not None and files.groups is not None  # the config allows natural with files only
        return natural(files.groups, config.clients, p.min_samples)
    if p.scheme == "from_file":
        assert p.file is not None  # PartitionConfig.validate
        return read_assignment(
            p.file, len(labels), config.clients, allow_overlap=p.allow_overlap, min_samples=p.min_samples
        )
    return partition(
        labels,
        config.clients,
        p.scheme,
        numpy_rng(data_seed(config), "partition"),
        alpha=p.alpha,
        shards_per_client=p.shards_per_client,
        classes_per_client=p.classes_per_client,
        sizes=p.sizes,
        min_samples=p.min_samples,
    )


def generated_clients(config: Config) -> GeneratedClients:
    """The clients of ``synthetic`` with ``per_client``: each generates its data on demand,
    around the class means the data seed gives (the test set's)."""
    task = config.task
    _, features, classes, per_client = synthetic_options(task.dataset_options)
    seed = data_seed(config)
    return GeneratedClients(
        seed,
        config.clients,
        per_client,
        synthetic_means(np.random.default_rng(seed), features, classes),
        scheme=task.partition.scheme,
        alpha=task.partition.alpha,
        local_test_fraction=task.local_test_fraction,
        min_samples=task.partition.min_samples,
    )


def initial_params(config: Config, task: TaskBundle) -> Params:
    """The seeded initial global model (the same in every process), after the strategy's
    ``check_model`` (if it has one) accepted the model."""
    with TORCH_GLOBAL:  # seeded and drawn from without another thread's draws in between
        torch.manual_seed(derive_seed(config.seed, "init"))
        model = task.make_model()
    strategy = strategy_class(config)
    if isinstance(strategy, ChecksModel):  # e.g. MOON needs a representation, FedPer its personal layers
        strategy.check_model(model, config.strategy.params)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def update_checks(config: Config, task: TaskBundle, params: Params) -> UpdateChecks:
    """What the server checks each update against (:mod:`fedweave.federated.checks`): the strategy's
    schema (by default every entry of the model's ``params``), the example limits (in an
    in-memory simulation the server holds every client's data, so it knows each one's
    size), the weight share, the bound of each claim relative to its cohort."""
    cls = strategy_class(config)
    if isinstance(cls, DeclaresUpdate):
        with TORCH_GLOBAL, torch.random.fork_rng(devices=[]):  # a model for its layers; the run's draws are untouched
            schema = cls.update_schema(task.make_model(), config.strategy.params)
    else:
        schema = UpdateSchema.of(params)
    size_of = task.clients.train_size if config.transport.kind == "inmemory" else None
    return UpdateChecks(
        schema=dataclasses.replace(schema, kind=cls.update_kind),
        limits=ExampleLimits(config.aggregation.max_examples, size_of),
        max_weight_share=config.aggregation.max_weight_share,
        weights=WeightPolicy.of(config.aggregation),
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


def build_deadlines(config: Config) -> Deadlines | None:
    """The job deadlines and back-off of a run over gRPC (:mod:`fedweave.deadlines`); None in
    simulation, whose clients always answer, and with ``grpc.job_deadline_factor`` none."""
    g = config.grpc
    if config.transport.kind != "grpc" or g.job_deadline_factor is None:
        return None
    return Deadlines(config.clients, g.job_deadline_factor, g.job_deadline_quantile, g.job_deadline_min,
                     g.missed_deadline_backoff, config.seed)


def build_controller(config: Config) -> Controller:
    """The federated controller: ``controller.kind`` static (configured work) or adaptive; its clients
    chosen by ``selection``."""
    local, selection = config.local, build_selection(config.selection)
    configured = StaticController(
        config.clients, config.clients_per_round, batch_size=local.batch_size, epochs=local.epochs,
        local_steps=local.steps, seed=config.seed, selection=selection,
    )
    return AdaptiveController(configured, config.controller) if config.controller.kind == "adaptive" else configured


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
    ``local.device``; its batches are moved there); with no test set (``task.dataset: files`` without
    ``test_path``) the server evaluates nothing, and says so."""
    if not len(task.dataset.y_test):
        logger.info(
            "no central test set (task.dataset_options.test_path is not set): the server evaluates nothing; "
            "the run evaluates on the clients' local test splits only"
        )
        return lambda params: {}
    model = task.make_model().to(resolve(config.local.device, "local.device"))

    def evaluate_global(params: Params) -> dict[str, float]:
        model.load_state_dict(params)
        return evaluate(model, task.dataset.x_test, task.dataset.y_test, task.loss_fn, batch_size=config.eval.batch_size)

    return evaluate_global


def federated_eval_every(config: Config, task: TaskBundle) -> int:
    """Rounds between evaluations on the clients' local test splits: ``eval.federated_every``, or,
    when the server has no test set, the cadence ``eval.every`` gives the central one (0: the last round)."""
    if config.eval.federated_every or len(task.dataset.y_test):
        return config.eval.federated_every
    return config.eval.every or config.rounds
