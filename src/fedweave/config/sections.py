"""Config sections of what a run trains and how: task, local training, strategy, aggregation,
attacks, plugins, evaluation, checkpoints, observation."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from fedweave.errors import ConfigError
from fedweave.schema import opt, parse


PartitionScheme = Literal[
    "iid", "dirichlet", "shards", "quantity", "inner_dirichlet", "pathological", "linear", "square", "exponential",
    "natural", "from_file",
]


@dataclass
class PartitionConfig:
    SHORTHAND = "scheme"
    scheme: PartitionScheme = opt(
        "iid",
        help="how training data is split across clients: iid | dirichlet | inner_dirichlet | shards | pathological "
        "(label skew) | quantity | linear | square | exponential (size skew) | natural (one client per value of by) "
        "| from_file (a JSON map client -> rows)",
    )
    alpha: float = opt(
        0.5, gt=0, help="Dirichlet concentration (dirichlet, inner_dirichlet, quantity): lower is more skewed"
    )
    shards_per_client: int = opt(2, ge=1, help="label-sorted shards per client (shards)")
    classes_per_client: int = opt(2, ge=1, help="classes each client holds (pathological)")
    sizes: list[int] | None = opt(None, help="each client's sample count (inner_dirichlet; none: as even as possible)")
    by: str | None = opt(None, help="the column whose distinct values are the clients (natural; LEAF: its users)")
    file: str | None = opt(None, help="JSON map client id -> training row indices (from_file)")
    allow_overlap: bool = opt(False, help="from_file: a row may belong to several clients")
    seed: int | None = opt(None, ge=0, help="seed of the data split (holdout, partition, local test splits); none: seed")
    min_samples: int = opt(2, ge=1, help="fewest training samples any client may get")

    def validate(self, prefix: str) -> None:
        used = {"sizes": ("inner_dirichlet", self.sizes is not None), "by": ("natural", self.by is not None),
                "file": ("from_file", self.file is not None), "allow_overlap": ("from_file", self.allow_overlap)}
        for key, (scheme, given) in used.items():
            if given and self.scheme != scheme:
                raise ConfigError(f"config key '{prefix}.{key}': only scheme {scheme} uses it, the scheme is {self.scheme!r}")
        if self.scheme == "from_file" and self.file is None:
            raise ConfigError(f"config key '{prefix}.file': scheme from_file needs the JSON file mapping clients to rows")


LABEL_SCHEMES = ("dirichlet", "shards", "inner_dirichlet", "pathological")
"""The partition schemes that split by class id."""

def _installed(module: str) -> bool:
    """Whether ``module`` can be imported, found without importing it."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # hidden by an import hook, or a module without a spec
        return False


HF_MODEL = "hf:"
"""The prefix of ``task.model`` that names a local folder of a ``transformers`` model."""


@dataclass
class PeftConfig:
    """``task.peft``: parameter-efficient fine-tuning of a ``task.model: hf:PATH`` model; only the
    adapters train and travel (:mod:`fedweave.task.lora`)."""

    SHORTHAND = "method"
    method: Literal["lora"] | None = opt(None, help="lora (LoRA adapters) | none: every weight of the model trains")
    r: int = opt(8, ge=1, help="rank of each LoRA adapter")
    alpha: float = opt(16.0, gt=0, help="LoRA scaling numerator: an adapter's product is scaled by alpha / r")
    dropout: float = opt(0.0, ge=0, lt=1, help="dropout on the input of each adapter")
    target_modules: list[str] = opt(
        factory=lambda: ["c_attn"],
        help="names (suffixes) of the modules that get adapters, as peft matches them (GPT-2: c_attn, c_proj, c_fc)",
    )
    merged: bool = opt(False, help="also write the base model with the adapters merged in (run folder merged/)")

    def validate(self, prefix: str) -> None:
        if not self.target_modules or any(not m.strip() for m in self.target_modules):
            raise ConfigError(f"config key '{prefix}.target_modules': expected module names, got {self.target_modules}")
        if self.merged and self.method is None:
            raise ConfigError(f"config key '{prefix}.merged': only adapters (method lora) are merged")


@dataclass
class TaskConfig:
    dataset: str = opt(
        "digits",
        help="digits | mnist5k | synthetic | diabetes (kind regression) | multilabel (kind multilabel, generated) | "
        "torchvision:mnist | torchvision:cifar10 | files (the sites' own files, "
        "see dataset_options: path, format, label, ...) | package.module:function "
        "called f(seed=..., **dataset_options) returning (x_train, y_train, x_test, y_test), or (x, y) whose "
        "test split is carved by test_fraction, or a fedweave.task.Dataset; x float arrays, y integer labels "
        "(regression, multilabel: float targets)",
    )
    dataset_options: dict[str, Any] = opt(factory=dict, help="keyword arguments of the dataset")
    data_root: str | None = opt(None, help="local folder of torchvision datasets")
    model: str = opt(
        "mlp",
        help="mlp | cnn | hf:PATH (a transformers causal language model saved in the local folder PATH, "
        "kind language_model; extra hf) | package.module:function called f(**model_options, input_shape=(...), "
        "num_classes=N) returning a torch.nn.Module whose output is (batch, num_classes) logits",
    )
    model_options: dict[str, Any] = opt(factory=dict, help="keyword arguments of the model")
    kind: Literal["classification", "regression", "multilabel", "language_model"] = opt(
        "classification",
        help="what the model predicts: classification (class ids) | regression (float targets, shape [n] or "
        "[n, k]) | multilabel (0/1 label matrices) | language_model (next token); the built-in models' output "
        "size follows (classes, targets, labels)",
    )
    loss: str | None = opt(
        None,
        help="training loss (none: the kind's first): classification: cross_entropy | nll | bce (binary "
        "cross-entropy of each logit against the one-hot label); regression: mse | huber; multilabel: bce (per "
        "label); language_model: next_token (shifted cross-entropy, padding -100 ignored); or "
        "package.module:function called f(outputs, labels) returning the batch's mean loss",
    )
    metrics: list[str] | None = opt(
        None,
        help="evaluation metrics (none: classification accuracy; regression mae, rmse, r2; multilabel accuracy, "
        "f1_macro; language_model perplexity): accuracy | f1_macro | auroc (classification, multilabel) | mae | "
        "rmse | r2 (regression) | perplexity (language_model) | package.module:function called "
        "f(outputs, targets) returning a float, recorded under its function's name",
    )
    peft: PeftConfig = opt(factory=PeftConfig)
    sequence_length: int = opt(
        128, ge=2, help="language_model: tokens per training block (text is tokenised and cut into blocks this long)"
    )
    tokenizer: str | None = opt(
        None, help="language_model: a local folder of a transformers tokenizer (none: bytes, a vocabulary of 256)"
    )
    test_fraction: float = opt(0.2, gt=0, lt=1, help="share of the data held out as the global test set")
    local_test_fraction: float = opt(0.2, ge=0, lt=1, help="share of each client's data kept as its local test split")
    partition: PartitionConfig = opt(factory=PartitionConfig)

    def validate(self, prefix: str) -> None:
        from fedweave.task.metrics import FITS
        from fedweave.task.models import LOSSES

        if self.loss is not None and self.loss not in LOSSES[self.kind] and ":" not in self.loss:
            raise ConfigError(
                f"config key '{prefix}.loss': {self.loss!r} is not a loss of kind {self.kind}; valid: "
                f"{', '.join(LOSSES[self.kind])} or package.module:function"
            )
        for name in self.metrics or []:
            if name not in FITS[self.kind] and ":" not in name:
                raise ConfigError(
                    f"config key '{prefix}.metrics': {name!r} is not a metric of kind {self.kind}; valid: "
                    f"{', '.join(FITS[self.kind])} or package.module:function"
                )
        recorded = [name.rpartition(":")[2] for name in self.metrics or []]
        if len(set(recorded)) != len(recorded):
            raise ConfigError(f"config key '{prefix}.metrics': {self.metrics} records a metric twice")
        hf = self.model.startswith(HF_MODEL)
        if hf and self.kind != "language_model":
            raise ConfigError(
                f"config key '{prefix}.model': hf:PATH is a causal language model; set {prefix}.kind: language_model"
            )
        if hf and not self.model[len(HF_MODEL):].strip():
            raise ConfigError(f"config key '{prefix}.model': hf: needs the model's local folder, hf:PATH")
        if hf:
            for module in ("transformers", "peft") if self.peft.method is not None else ("transformers",):
                if not _installed(module):
                    raise ConfigError(
                        f"config key '{prefix}.model': {self.model} needs {module}, which is not installed; it "
                        "comes with the extra hf: pip install 'fedweave[hf]'"
                    )
        if self.peft.method is not None and not hf:
            raise ConfigError(
                f"config key '{prefix}.peft.method': adapters wrap a transformers model; set {prefix}.model: hf:PATH"
            )
        if hf and self.model_options:
            raise ConfigError(
                f"config key '{prefix}.model_options': an hf: model is configured by its folder's config.json; drop them"
            )
        scheme = self.partition.scheme
        if self.kind != "classification" and scheme in LABEL_SCHEMES:
            raise ConfigError(
                f"config key '{prefix}.partition.scheme': {scheme} splits by class, a {self.kind} task has no "
                "classes; use iid, quantity, linear, square, exponential, natural or from_file"
            )
        if self.dataset != "files":
            if scheme == "natural":
                raise ConfigError(
                    f"config key '{prefix}.partition.scheme': natural needs {prefix}.dataset: files "
                    "(clients by a column, or LEAF's users)"
                )
            return
        options = self.file_options(prefix)
        reads_text = options.format == "text" or options.text is not None
        if self.kind == "language_model" and options.format is not None and not reads_text:
            raise ConfigError(
                f"config key '{prefix}.dataset_options.format': a language model reads text: format text, or jsonl "
                f"with its text field ({prefix}.dataset_options.text), got {options.format}"
            )
        if reads_text and self.kind != "language_model":
            raise ConfigError(
                f"config key '{prefix}.kind': text is read into token blocks for kind language_model, got {self.kind}"
            )
        if options.template and scheme != "iid":
            raise ConfigError(
                f"config key '{prefix}.partition.scheme': each client reads its own file ({{client}} in "
                f"{prefix}.dataset_options.path), so no scheme {scheme!r} applies; drop it"
            )
        if scheme == "natural" and self.partition.by is None and options.format not in (None, "leaf"):
            raise ConfigError(
                f"config key '{prefix}.partition.by': scheme natural needs the column whose values are the clients"
            )

    def file_options(self, prefix: str = "task") -> Any:
        """``dataset_options`` of ``dataset: files``, parsed (a
        :class:`fedweave.task.sources.FileOptions`)."""
        from fedweave.task.sources.options import FileOptions

        return parse(FileOptions, self.dataset_options, f"{prefix}.dataset_options")


@dataclass
class LocalConfig:
    epochs: int = opt(1, ge=1, help="local passes over the client's data per round")
    steps: int | None = opt(None, ge=1, help="local steps per round; overrides epochs when set")
    batch_size: int = opt(32, ge=1, help="local mini-batch size")
    optimizer: Literal["sgd", "adam"] = opt("sgd", help="local optimiser")
    lr: float = opt(0.05, gt=0, help="local learning rate")
    momentum: float = opt(0.0, ge=0, lt=1, help="SGD momentum")
    weight_decay: float = opt(0.0, ge=0, help="L2 weight decay")
    device: str = opt(
        "cpu",
        help="where clients train and the server evaluates (model, batches, optimiser state): auto (cuda if this "
        "machine has it, else mps, else cpu) | cpu | cuda | cuda:N | mps; updates travel on the cpu",
    )

    def validate(self, prefix: str) -> None:
        if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", self.device):
            raise ConfigError(
                f"config key '{prefix}.device': {self.device!r} is not a device; expected auto, cpu, cuda, cuda:N or mps"
            )


@dataclass
class SimulationConfig:
    """How an in-memory simulation runs its clients (:mod:`fedweave.cohort`); the models it trains
    are the same whatever these say, up to float rounding."""

    cohort: int | Literal["auto", "off", False] = opt(
        "auto",
        help="train a round's clients as vectorised cohorts: auto (where the strategy, plugins, model and "
        "loss allow it, groups as large as cohort_memory allows; a model with convolutions on a CPU trains "
        "one client after another) | off (one client after another) | K (groups of at most K clients, and "
        "of what cohort_memory allows)",
    )
    cohort_memory: int = opt(1024, ge=1, help="MiB a cohort's stacked parameters, optimiser state and activations may take")
    workers: int = opt(
        1, ge=1, help="processes that train clients (each on local.device, round-robin over CUDA devices); 1: this process"
    )

    def validate(self, prefix: str) -> None:
        if self.cohort is False:  # YAML reads a bare off as false
            self.cohort = "off"
        if isinstance(self.cohort, int) and self.cohort < 1:
            raise ConfigError(f"config key '{prefix}.cohort': must be auto, off or a group size >= 1, got {self.cohort}")


@dataclass
class StrategyConfig:
    """``name`` plus the hyper-parameters the named strategy declares in its ``HParams``."""

    SHORTHAND = "name"
    name: str = opt("fedavg", help="fedavg | package.module:Class")
    params: Any = None


@dataclass
class SelectionConfig:
    """Which clients a synchronous round samples (:mod:`fedweave.federated.selection`)."""

    SHORTHAND = "name"
    name: str = opt("uniform", help="uniform | power_of_choice | oort | package.module:Class (constructed "
                    "with this section)")
    candidates: int | None = opt(None, ge=1, help="power_of_choice: clients drawn, d, of which the "
                                 "highest-loss ones train (none: twice the clients per round)")
    exploration: float = opt(0.9, ge=0, le=1, help="oort: initial share of slots exploring unseen clients")
    exploration_decay: float = opt(0.98, gt=0, le=1, help="oort: factor on the exploring share each round")
    min_exploration: float = opt(0.3, ge=0, le=1, help="oort: the exploring share decays no lower")
    penalty: float = opt(2.0, ge=0, help="oort: alpha of the system penalty (T / t_i)^alpha of a slow client")
    cutoff: float = opt(0.95, gt=0, le=1, help="oort: exploit clients whose utility reaches this share of the "
                        "last exploiting slot's")
    percentile: float = opt(30.0, ge=0, le=100, help="oort: the preferred round duration T is this percentile "
                            "of the explored clients' durations")
    pacer_window: int = opt(20, ge=1, help="oort: rounds per pacer window")
    pacer_step: float = opt(5.0, ge=0, help="oort: percentile points T's percentile rises when the exploited "
                            "utility fell from one window to the next")
    options: dict[str, Any] = opt(factory=dict, help="settings of a user's selection class")

    def validate(self, prefix: str) -> None:
        from fedweave.federated.selection import selection_class

        selection_class(self.name, f"{prefix}.name")


@dataclass
class AggregationConfig:
    """How the server combines the clients' tensors; the robust rules are in :mod:`fedweave.strategies.robust`."""

    SHORTHAND = "rule"
    rule: Literal["mean", "median", "trimmed_mean", "krum", "multi_krum"] = opt(
        "mean",
        help="how client tensors are combined: mean (weighted by examples) | median | trimmed_mean "
        "(both coordinate-wise, unweighted) | krum | multi_krum (Byzantine-robust selection)",
    )
    trim_fraction: float = opt(0.1, ge=0, lt=0.5, help="trimmed_mean: share of values dropped at each end")
    byzantine: int = opt(1, ge=0, help="krum, multi_krum: assumed Byzantine clients f (needs > 2f + 2 updates)")
    multi_krum_m: int | None = opt(None, ge=1, help="multi_krum: updates selected and averaged (none: n - f)")
    max_examples: int | None = opt(
        None,
        ge=1,
        help="most examples one client may claim; a larger claim counts as this many (an encoded one is "
        "rejected). In-memory simulations also cap each claim at the client's true partition size",
    )
    max_weight_share: float | None = opt(
        None,
        gt=0,
        le=1,
        help="largest share of a round's total weight one update may carry; larger weights are lowered to "
        "a common cap (none: no cap; needs updates in the clear)",
    )
    weight_policy: Literal["cap", "refuse", "trust"] = opt(
        "cap",
        help="what the server does with a claimed example count above max_ratio_to_median x the lower median "
        "of its cohort's claims per client (a site's: times its members; FedBuff: its buffer and every other "
        "client's latest claim): cap (count it as the bound; an encoded update is refused) | refuse (drop the "
        "update) | trust (take every claim as it is)",
    )
    max_ratio_to_median: float = opt(
        3.0, ge=1, help="weight_policy cap or refuse: the most one client may claim, as a multiple of the "
        "cohort's median claim per client",
    )

    def validate(self, prefix: str) -> None:
        if self.multi_krum_m is not None and self.rule != "multi_krum":
            raise ConfigError(
                f"config key '{prefix}.multi_krum_m': only rule 'multi_krum' uses it, but the rule is {self.rule!r}"
            )


AttackKind = Literal["none", "sign_flip", "scaling", "noise", "label_flip", "inflate_examples"]


@dataclass
class AttacksConfig:
    """Simulated attackers, for measuring defences: see :mod:`fedweave.plugins.attacks.poison`."""

    SHORTHAND = "kind"
    kind: AttackKind | list[AttackKind] = opt(
        "none",
        help="what the attacking clients do, one or a list: none | sign_flip (send -scale x the update) | "
        "scaling (scale x) | noise (add seeded N(0, std^2)) | label_flip (train on labels C-1-y) | "
        "inflate_examples (claim examples)",
    )
    clients: list[int] = opt(factory=list, help="ids of the attacking clients")
    scale: float = opt(1.0, gt=0, help="sign_flip, scaling: the factor applied to the update")
    std: float = opt(1.0, gt=0, help="noise: standard deviation of the noise added to each entry")
    examples: int = opt(1_000_000, ge=1, help="inflate_examples: the example count claimed")

    @property
    def kinds(self) -> list[str]:
        """The attacks, in the order they apply (none: empty)."""
        kinds = self.kind if isinstance(self.kind, list) else [self.kind]
        return [k for k in kinds if k != "none"]

    def validate(self, prefix: str) -> None:
        kinds = self.kind if isinstance(self.kind, list) else [self.kind]
        if len(set(kinds)) != len(kinds) or ("none" in kinds and len(kinds) > 1):
            raise ConfigError(f"config key '{prefix}.kind': {self.kind} names an attack twice or with none")
        if (not self.kinds) != (not self.clients):
            raise ConfigError(
                f"config key '{prefix}.clients': an attack needs attacking clients and clients need an attack "
                f"(kind {self.kind!r}, clients {self.clients})"
            )
        if len(set(self.clients)) != len(self.clients):
            raise ConfigError(f"config key '{prefix}.clients': {self.clients} names a client twice")
        if "scaling" in kinds and self.scale == 1:
            raise ConfigError(f"config key '{prefix}.scale': scaling by 1 changes nothing; set another factor")


@dataclass
class PluginSpec:
    name: str
    params: Any = None


@dataclass
class PluginsConfig:
    server_send: list[PluginSpec] = opt(factory=list, help="encode the broadcast on the server")
    client_receive: list[PluginSpec] = opt(factory=list, help="filter instructions on the client")
    client_send: list[PluginSpec] = opt(factory=list, help="encode updates on the client")
    server_receive: list[PluginSpec] = opt(factory=list, help="filter updates on the server")


@dataclass
class EvalConfig:
    every: int = opt(1, ge=0, help="evaluate the global model on the test set every N rounds (0: last round only)")
    federated_every: int = opt(0, ge=0, help="evaluate on clients' local test splits every N rounds (0: never)")
    federated_fraction: float = opt(1.0, gt=0, le=1, help="share of clients in a federated evaluation")
    batch_size: int = opt(1024, ge=1, help="evaluation batch size")
    fit_metrics_aggregation: str | None = opt(
        None,
        help="package.module:function called f([(num_examples, metrics), ...]) with the clients' training "
        "metrics, returning a dict of floats recorded as fit_<name> (none: only the weighted train_loss)",
    )
    evaluate_metrics_aggregation: str | None = opt(
        None,
        help="package.module:function called f([(num_examples, metrics), ...]) with the clients' evaluation "
        "metrics, returning a dict of floats recorded as federated_<name> (none: the mean weighted by examples)",
    )
    server_function: str | None = opt(
        None,
        help="package.module:function called f(params) with the global parameters (name -> tensor) whenever "
        "the server evaluates, returning a dict of floats recorded as server_<name>",
    )
    per_client: bool = opt(
        False,
        help="record each client's evaluation metrics (federated_per_client: client id -> metrics); refused "
        "with a differential-privacy plugin",
    )

    def validate(self, prefix: str) -> None:
        for key in ("fit_metrics_aggregation", "evaluate_metrics_aggregation", "server_function"):
            spec = getattr(self, key)
            module, _, function = (spec or "x:y").partition(":")
            if not module or not function:
                raise ConfigError(f"config key '{prefix}.{key}': {spec!r} is not of the form 'package.module:function'")
        if self.per_client and not self.federated_every:
            raise ConfigError(
                f"config key '{prefix}.per_client': clients evaluate only with {prefix}.federated_every > 0"
            )


SIMULATION_CHECKPOINT_INTERVAL = 30.0
"""Seconds at least between two checkpoints of a simulated federated run, by default."""


@dataclass
class CheckpointConfig:
    every: int = opt(1, ge=0, help="write the server state every N rounds (0: never)")
    min_interval: float | None = opt(
        None, ge=0, help="seconds at least between two checkpoints of a federated run; the last round run is "
        "always written, also when the run stops early (privacy budget spent, no client left) "
        f"(none: {SIMULATION_CHECKPOINT_INTERVAL:g} in simulation, where a resumed run redoes the rounds since "
        "exactly; 0 over a network transport, whose clients keep the state of the last round, and with a plugin "
        "that draws from the OS each round (privacy noise without seeded_noise, secagg, he), whose rounds done "
        "again differ; with privacy noise a value > 0 is refused)"
    )

    def interval(self, transport: str, fresh_draws: bool) -> float:
        """``min_interval`` for a run over ``transport`` (``transport.kind``); ``fresh_draws``: a plugin of
        the run draws from the OS's secure source each round (:func:`fedweave.plugins.compose.fresh_draws`)."""
        if self.min_interval is not None:
            return self.min_interval
        return SIMULATION_CHECKPOINT_INTERVAL if transport == "inmemory" and not fresh_draws else 0.0


@dataclass
class MlflowConfig:
    """MLflow tracking (extra ``mlflow``): see :mod:`fedweave.observe.mlflow`."""

    enabled: bool | None = opt(None, help="log to MLflow (none: when tracking_uri or experiment is set)")
    tracking_uri: str | None = opt(None, help="tracking URI (none: a SQLite store, RUN_DIR/mlflow.db)")
    experiment: str | None = opt(None, help="experiment name (none: the run's name)")

    @property
    def on(self) -> bool:
        return self.enabled if self.enabled is not None else bool(self.tracking_uri or self.experiment)


@dataclass
class ObserveConfig:
    """Where a run's metrics go besides metrics.jsonl (see :mod:`fedweave.observe.loggers`)."""

    tensorboard: bool | str = opt(
        False, help="TensorBoard event files (extra tensorboard): true for RUN_DIR/tensorboard, or a folder"
    )
    mlflow: MlflowConfig = opt(factory=MlflowConfig)
    prometheus_port: int | None = opt(
        None, ge=1, le=65535, help="serve Prometheus metrics on this port from the server (extra prometheus)"
    )

    def validate(self, prefix: str) -> None:
        if self.tensorboard == "":
            raise ConfigError(f"config key '{prefix}.tensorboard': expected true, false or a folder, got ''")
