"""Config sections of heterogeneity-aware training: batch and client controllers, staleness,
data parallelism, emulated heterogeneity, asynchronous aggregation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fedweave.errors import ConfigError
from fedweave.schema import opt


@dataclass
class BatchControllerConfig:
    """How the data-parallel controller splits the global batch (see :mod:`fedweave.data_parallel.controller`)."""

    SHORTHAND = "policy"
    policy: Literal["dynamic", "static"] = opt(
        "dynamic", help="dynamic: batch sizes follow measured throughput | static: equal batches"
    )
    cadence: Literal["steps", "epoch"] = opt("steps", help="adjust every `every` measured steps, or once per epoch")
    every: int = opt(10, ge=1, help="measured steps between adjustments (cadence: steps)")
    warmup: int = opt(1, ge=0, help="steps left unmeasured after each change of the batch sizes")
    ewma: float = opt(0.3, gt=0, le=1, help="weight of the newest throughput sample in its moving average")
    dead_band: float = opt(0.05, ge=0, help="no change while max_i t_i / mean t < 1 + dead_band")
    min_batch: int = opt(1, ge=0, help="smallest per-worker batch")
    max_batch: int | None = opt(None, ge=1, help="largest per-worker batch (none: no limit)")
    memory_guard: bool = opt(False, help="cap a worker's batch when its throughput falls after an increase, or on OOM")
    guard_drop: float = opt(0.25, gt=0, lt=1, help="relative throughput fall after an increase that trips the guard")

    def validate(self, prefix: str) -> None:
        if self.max_batch is not None and self.max_batch < self.min_batch:
            raise ConfigError(
                f"config key '{prefix}.max_batch': {self.max_batch} is below min_batch={self.min_batch}"
            )


@dataclass
class StalenessOptions:
    """How asynchronous aggregation weighs an update computed on an older model: FedBuff
    (``asynchronous``) and the data-parallel parameter server (``data_parallel.sync: asp``)."""

    staleness: Literal["polynomial", "constant", "hinge"] = opt(
        "polynomial",
        help="weight s(t) of an update t server steps old: polynomial (1 + t)^-exponent | constant 1 | "
        "hinge 1 while t <= hinge_b, then 1 / (hinge_a (t - hinge_b) + 1)",
    )
    exponent: float = opt(0.5, ge=0, help="staleness polynomial: s(t) = (1 + t)^-exponent")
    hinge_a: float = opt(10.0, ge=0, help="staleness hinge: slope after hinge_b")
    hinge_b: int = opt(4, ge=0, help="staleness hinge: server steps an update may be old at full weight")
    max_staleness: int | None = opt(None, ge=0, help="updates older than this many server steps are dropped")


@dataclass
class DataParallelConfig(StalenessOptions):
    """Data-parallel SGD over torch.distributed (``mode: data_parallel``): synchronous steps
    (``sync: bsp``) or a parameter server (``sync: asp``, see :mod:`fedweave.data_parallel.asp`)."""

    workers: int = opt(2, ge=1, help="worker processes started on this machine")
    global_batch: int = opt(64, ge=1, help="samples per step over all workers (B = sum of the b_i)")
    epochs: int = opt(1, ge=1, help="passes over the training set")
    steps: int | None = opt(None, ge=1, help="optimiser steps in all; overrides epochs when set")
    optimizer: Literal["sgd", "adam"] = opt("sgd", help="optimiser every worker applies to the summed gradient")
    lr: float = opt(0.05, gt=0, help="learning rate")
    momentum: float = opt(0.0, ge=0, lt=1, help="SGD momentum")
    weight_decay: float = opt(0.0, ge=0, help="L2 weight decay")
    backend: Literal["auto", "gloo", "nccl"] = opt("auto", help="auto: nccl when CUDA is present, else gloo")
    timeout: float = opt(30.0, gt=0, help="seconds a collective or a re-formation waits before a worker counts as lost")
    min_workers: int = opt(1, ge=1, help="fewest surviving workers that continue after a failure")
    log_every: int = opt(10, ge=1, help="steps per metrics line (and at each epoch's end)")
    checkpoint_every: int = opt(
        0, ge=0, help="steps between checkpoints, which an elastic torchrun job resumes from after a world change "
        "(0: at epoch ends, as checkpoint.every says)"
    )
    sync: Literal["bsp", "asp"] = opt(
        "bsp",
        help="bsp: synchronous steps, every worker waits for the slowest | asp: a parameter server applies each "
        "worker's gradient as it arrives, nobody waits (see fedweave.data_parallel.asp)",
    )
    buffer: int = opt(1, ge=1, help="asp: arriving gradients summed into one server step (K)")
    max_grad_norm: float | None = opt(
        None, gt=0, help="bsp: the largest L2 norm of one worker's mean gradient; a step with a larger one is "
        "skipped (none: no absolute bound)",
    )
    max_norm_ratio: float | None = opt(
        None, gt=1, help="bsp: a step is skipped when one worker's mean gradient's norm is above this many times "
        "the median of the workers' (none: no relative bound; honest mini-batch norms can differ 100-fold near "
        "convergence); a non-finite gradient is always skipped",
    )
    max_bad_steps: int = opt(
        3, ge=1, help="bsp: skipped steps (a non-finite or too large gradient) after which the run stops with an error",
    )

    def validate(self, prefix: str) -> None:
        if self.sync == "asp" and self.max_grad_norm is not None:
            raise ConfigError(
                f"config key '{prefix}.max_grad_norm': only sync bsp checks each worker's gradient before its step; "
                "the parameter server (asp) does not"
            )
    controller: BatchControllerConfig = opt(factory=BatchControllerConfig)


@dataclass
class SpeedChange:
    step: int = opt(ge=0, help="step from which the new speed applies")
    worker: int = opt(ge=0, help="worker index")
    speed: float = opt(gt=0, help="the worker's new relative speed")


@dataclass
class Crash:
    step: int = opt(ge=0, help="step at which the worker kills itself (before its all-reduce)")
    worker: int = opt(ge=0, help="worker index")


@dataclass
class Join:
    step: int = opt(ge=1, help="first step the new worker takes part in")
    worker: int = opt(ge=0, help="the new worker's index: data_parallel.workers for the first join, then + 1")


@dataclass
class HeterogeneityConfig:
    """Emulated unlike machines on one box (see :mod:`fedweave.emulation`)."""

    speeds: list[float] = opt(
        factory=list, help="relative speed per worker (federated: per client), e.g. [1, 2, 4] (empty: no emulation)"
    )
    slowdown: float = opt(1.0, ge=1, help="the fastest configured worker runs this many times slower than native")
    threads: list[int] = opt(factory=list, help="torch threads per worker (empty: the run's threads)")
    schedule: list[SpeedChange] = opt(factory=list, help="speed changes during training: [{step, worker, speed}]")
    crashes: list[Crash] = opt(factory=list, help="emulated crashes: [{step, worker}] (the worker is SIGKILLed)")
    joins: list[Join] = opt(
        factory=list, help="emulated joins: [{step, worker}] (a new worker joins the running job at that step)"
    )
    speed_range: list[float] = opt(
        factory=list,
        help="federated: [low, high], each client's speed drawn uniformly from it, seeded (not with speeds)",
    )
    clock: Literal["real", "virtual"] = opt(
        "real",
        help="federated simulation: real = a client sleeps to last its speed factor x its measured compute time | "
        "virtual = no sleeps: a client's compute time is its samples x sample_time / speed (deterministic)",
    )
    sample_time: float = opt(1e-3, gt=0, help="clock virtual: seconds a client of speed 1 takes per training sample")


@dataclass
class ClientControllerConfig:
    """The federated controller: each sampled client's local work (see :mod:`fedweave.federated.adaptive`)."""

    SHORTHAND = "kind"
    kind: Literal["static", "adaptive"] = opt(
        "static",
        help="static: every client does the configured local work | adaptive: work from each client's measured "
        "speed, so that the round's clients finish together near target_round_time",
    )
    adjust: Literal["steps", "batch_size"] = opt(
        "steps",
        help="adaptive: a client's local steps follow its speed (batches of local.batch_size) | its batch size "
        "follows its speed (local.steps steps each)",
    )
    target_round_time: float | None = opt(
        None, gt=0, help="adaptive: seconds of local work per round (none: median compute time of the first round)"
    )
    ewma: float = opt(0.5, gt=0, le=1, help="adaptive: weight of the newest measurement of a client's time per sample")
    min_steps: int = opt(1, ge=1, help="adaptive, adjust steps: fewest local steps a client is given")
    max_steps: int | None = opt(None, ge=1, help="adaptive, adjust steps: most local steps (none: no limit)")
    min_batch: int = opt(1, ge=1, help="adaptive, adjust batch_size: smallest batch a client is given")
    max_batch: int | None = opt(None, ge=1, help="adaptive, adjust batch_size: largest batch (none: no limit)")

    def validate(self, prefix: str) -> None:
        for low, high in (("min_steps", "max_steps"), ("min_batch", "max_batch")):
            top = getattr(self, high)
            if top is not None and top < getattr(self, low):
                raise ConfigError(f"config key '{prefix}.{high}': {top} is below {low}={getattr(self, low)}")


@dataclass
class AsynchronousConfig(StalenessOptions):
    """Buffered asynchronous aggregation, FedBuff (see :mod:`fedweave.federated.buffered`)."""

    enabled: bool = opt(
        False, help="server steps every buffer_size arriving updates, clients never wait (a round = one server step)"
    )
    buffer_size: int | None = opt(None, ge=1, help="K, updates per server step (none: the clients a round samples)")
    concurrency: int | None = opt(None, ge=1, help="clients training at once (none: every client)")
    server_lr: float = opt(1.0, gt=0, help="the server moves this share of the way to the buffer's aggregate")
